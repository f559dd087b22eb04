"""`phasesplit bench`: flags and the run loop.

Imports only the standard library at module level (the runtime CLI imports this module for every
subcommand, `serve` included); httpx, tokenizers, tqdm and matplotlib load inside run().

Exit status: 0 when every request succeeded; 1 when some failed (results are still written);
2 when the benchmark could not start (unreachable URL, unknown model, bad workload).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone

# One definition of the flag check; runtime/cli.py imports nothing heavy.
from phasesplit.runtime.cli import positive_int

DEFAULT_URL = "http://127.0.0.1:8000"


def _slo(text: str) -> dict[str, float]:
    from .metrics import parse_slo

    try:
        return parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rates(text: str) -> list[float]:
    from .load import parse_rates

    try:
        return parse_rates(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Benchmark an OpenAI-compatible server with streaming requests: TTFT, TPOT, ITL and "
                     "end-to-end latency percentiles, throughput, goodput under SLOs.")
    t = p.add_argument_group("target")
    t.add_argument("--url", default=DEFAULT_URL, help=f"server base URL (default {DEFAULT_URL})")
    t.add_argument("--model", default=None, help="model name to request (default: the only one /v1/models lists)")
    t.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions")
    t.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or a folder holding one) of the served model; "
                        "default: ask a phasesplit server for its own")
    t.add_argument("--api-key-env", default="OPENAI_API_KEY", help="env var with the API key to send, if set")
    t.add_argument("--timeout", type=_positive_float, default=600.0, help="seconds one request may take")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop at EOS instead of forcing the requested output length")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("fixed", "mixed", "trace"), default=None,
                   help="fixed lengths, mixed chat + long documents, or --trace (default: trace if --trace, else fixed)")
    w.add_argument("--num-prompts", type=positive_int, default=100, help="measured requests per rate")
    w.add_argument("--input-len", type=positive_int, default=1024, help="fixed: prompt tokens")
    w.add_argument("--output-len", type=positive_int, default=128, help="fixed: output tokens")
    w.add_argument("--chat-input-len", type=positive_int, default=128)
    w.add_argument("--chat-output-len", type=positive_int, default=64)
    w.add_argument("--doc-input-len", type=positive_int, default=1536)
    w.add_argument("--doc-output-len", type=positive_int, default=32)
    w.add_argument("--doc-fraction", type=float, default=0.2, help="mixed: share of long-document requests")
    w.add_argument("--range-ratio", type=float, default=0.25,
                   help="mixed: lengths drawn uniformly within +-this fraction")
    w.add_argument("--trace", default=None, help="Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)")
    w.add_argument("--trace-start", type=float, default=0.0, help="trace: skip rows before this many seconds")
    w.add_argument("--trace-time-scale", type=_positive_float, default=1.0,
                   help="trace: multiply arrival times (2 = half the rate)")
    w.add_argument("--trace-token-scale", type=_positive_float, default=1.0, help="trace: multiply token counts")
    w.add_argument("--max-input-len", type=positive_int, default=None, help="trace: clip prompt lengths")
    w.add_argument("--max-output-len", type=positive_int, default=None, help="trace: clip output lengths")

    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=_rates, default=None,
                    help="requests/s, comma-separated for a sweep; 'inf' sends all at once "
                         "(default: inf, or the trace's own arrival times with --trace)")
    lo.add_argument("--burstiness", type=_positive_float, default=1.0,
                    help="gamma shape of arrival gaps: 1 Poisson, <1 burstier, >1 steadier")
    lo.add_argument("--max-concurrency", type=positive_int, default=None,
                    help="most requests in flight; with rate inf this is a closed loop")
    lo.add_argument("--warmup", type=int, default=2, help="requests sent and discarded before measuring")
    lo.add_argument("--seed", type=int, default=0)
    lo.add_argument("--max-consecutive-errors", type=int, default=10,
                    help="stop a run when this many requests fail in a row before any succeeds (0: never)")

    o = p.add_argument_group("output")
    o.add_argument("--slo", type=_slo, default=None,
                   help="SLOs for goodput, e.g. ttft=500ms,itl=50ms (keys: ttft, tpot, itl, e2el)")
    o.add_argument("--label", default=None, help="name of this target in tables and plots (default: model)")
    o.add_argument("--output-json", default=None, help="write summaries and per-request results here")
    o.add_argument("--plot", default=None, metavar="DIR",
                   help="write latency-vs-rate and TTFT/ITL CDF PNGs into DIR")
    o.add_argument("--no-progress", dest="progress", action="store_false")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from .session import run_bench

    return asyncio.run(run_bench(args, started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                 argv=list(sys.argv), api_key=os.environ.get(args.api_key_env)))

