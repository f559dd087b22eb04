"""One `phasesplit bench` invocation: check the target, build the workload, warm up, run every
rate, report. Results are written after every rate, so a failure later keeps what was measured.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
import time
from pathlib import Path

import httpx

from . import report
from .client import BenchError, Target, choose_model, probe, remote_token_count, served_models, stream_one
from .load import ErrorBreaker, Interrupted, arrival_offsets, run_schedule, trace_offsets
from .metrics import RequestResult, summarize, summarize_by_kind
from .workload import (
    HFTokenizer,
    MixedShape,
    PromptBuilder,
    RequestSpec,
    TraceScaling,
    WorkloadError,
    fixed_workload,
    mixed_workload,
    read_trace,
    trace_workload,
)

# A server may publish its model's tokenizer.json here (asked first when --tokenizer is not given).
SERVER_TOKENIZER_PATH = "/v1/tokenizer.json"


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--url must start with http:// or https://, got {url!r}")
    return url


def load_local_tokenizer(spec: str) -> HFTokenizer:
    """--tokenizer: a tokenizer.json, a folder holding one, or a model phasesplit can resolve
    ('smollm2' or a .gguf file), read from its metadata by the runtime (no weights converted)."""
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".json":
        return HFTokenizer(p)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return HFTokenizer(p / "tokenizer.json")
        raise WorkloadError(f"--tokenizer {spec}: the folder has no tokenizer.json")
    if p.suffix == ".gguf" or spec == "smollm2":
        try:
            from phasesplit.runtime.model.files import ModelError, model_info
        except ImportError as e:
            raise WorkloadError(f"--tokenizer {spec}: the phasesplit runtime is needed to read it ({e})") from None
        try:
            return HFTokenizer(model_info(spec).folder / "tokenizer.json")
        except ModelError as e:
            raise WorkloadError(f"--tokenizer {spec}: {e}") from None
    raise WorkloadError(f"--tokenizer {spec}: expected a tokenizer.json file, a folder with one, or a .gguf file")


def builtin_tokenizer(model: str, owner: str) -> HFTokenizer | None:
    """A phasesplit server's bundled model: the same tokenizer, read locally by the runtime's loader."""
    if owner != "phasesplit":
        return None
    try:
        from phasesplit.runtime.model.files import BUILTIN_MODELS
    except ImportError:
        return None
    key = next((k for k, (_, _, served) in BUILTIN_MODELS.items() if served == model), None)
    return load_local_tokenizer(key) if key else None


async def server_tokenizer(client: httpx.AsyncClient, base_url: str, headers: dict, model: str,
                           owner: str) -> HFTokenizer:
    """The served model's tokenizer without --tokenizer: published by the server, or, for
    phasesplit's bundled model, read from the local copy of the same model. No other network."""
    url = base_url + SERVER_TOKENIZER_PATH
    try:
        resp = await client.get(url, headers=headers)
        if resp.status_code == 200:
            return HFTokenizer.from_json(resp.text)
        why = f"{url} answered {resp.status_code}"
    except httpx.HTTPError as e:
        why = f"cannot fetch {url}: {e}"
    local = builtin_tokenizer(model, owner)
    if local is not None:
        return local
    raise BenchError(f"no tokenizer for {model!r} ({why}); pass --tokenizer PATH/tokenizer.json, "
                     "the served model's own tokenizer, to build prompts of exact length")


def build_specs(args: argparse.Namespace, seed: int) -> tuple[list[RequestSpec], str]:
    kind = args.workload or ("trace" if args.trace else "fixed")
    if kind == "fixed":
        return fixed_workload(args.num_prompts, args.input_len, args.output_len), kind
    if kind == "mixed":
        shape = MixedShape(args.chat_input_len, args.chat_output_len, args.doc_input_len, args.doc_output_len,
                           args.doc_fraction, args.range_ratio)
        return mixed_workload(args.num_prompts, shape, seed), kind
    if not args.trace:
        raise WorkloadError("--workload trace needs --trace FILE.csv")
    scaling = TraceScaling(args.trace_start, args.trace_time_scale, args.trace_token_scale,
                           args.max_input_len, args.max_output_len)
    return trace_workload(read_trace(args.trace), args.num_prompts, scaling), kind


def _doc(args: argparse.Namespace, started: str, argv: list[str]) -> dict:
    doc = {
        "tool": "phasesplit bench",
        "started": started,
        "command": argv,
        "target": {"url": args.url, "model": args.model, "endpoint": args.endpoint},
        "label": args.label,
        "workload": {k: getattr(args, k) for k in (
            "workload", "num_prompts", "input_len", "output_len", "chat_input_len", "chat_output_len",
            "doc_input_len", "doc_output_len", "doc_fraction", "range_ratio", "trace", "trace_start",
            "trace_time_scale", "trace_token_scale", "max_input_len", "max_output_len")},
        "load": {"burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                 "warmup": args.warmup, "seed": args.seed},
        "slo": args.slo,
        "notes": [],
        "runs": [],
        "error": None,
    }
    if args.trace:
        doc["attribution"] = report.AZURE_ATTRIBUTION
    return doc


def _save(args: argparse.Namespace, doc: dict) -> None:
    if args.output_json:
        report.write_json(args.output_json, doc)


async def run_bench(args: argparse.Namespace, started: str, argv: list[str], api_key: str | None) -> int:
    doc = _doc(args, started, argv)
    # SIGINT/SIGTERM cancel the run; the rate in progress is summarised from what completed.
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await _run(args, doc, api_key)
    except asyncio.CancelledError:
        doc["error"] = "interrupted"
        _say("interrupted" + (f"; results so far kept in {args.output_json}" if args.output_json else ""))
        _save(args, doc)
        return 130
    except (BenchError, WorkloadError) as e:
        doc["error"] = str(e)
        _say(f"error: {e}")
        code = 1 if doc["runs"] else 2
        if args.output_json:
            _save(args, doc)
            _say(f"results so far kept in {args.output_json}")
        return code


async def _run(args: argparse.Namespace, doc: dict, api_key: str | None) -> int:
    base = normalize_url(args.url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        served = await served_models(client, base, headers)
        model = choose_model(served, args.model, base)
        doc["target"].update(url=base, model=model)
        label = args.label or model
        doc["label"] = label

        specs, kind = build_specs(args, args.seed)
        tok = load_local_tokenizer(args.tokenizer) if args.tokenizer else \
            await server_tokenizer(client, base, headers, model, served[model])
        builder = PromptBuilder(tok, args.seed)

        extra: dict = {"stream_options": {"include_usage": True}}
        if args.ignore_eos:
            extra.update(ignore_eos=True, min_tokens=0)
        target = Target(base, model, args.endpoint, args.temperature, extra, api_key)
        # Where the server counts tokens itself (/tokenize), check the prompts built here have the
        # exact length it will see before measuring anything.
        sample = builder.text(64)
        counted = await remote_token_count(client, target, sample)
        if counted is not None and counted != 64:
            raise WorkloadError(f"the server's /tokenize counts {counted} tokens in a prompt built as 64 with this "
                                "tokenizer; pass the served model's own tokenizer (--tokenizer)")
        doc["target"]["prompt_lengths_checked_by_server"] = counted is not None
        added, notes = await probe(client, target, builder.text(16), 16)
        for n in notes:
            _say(n)
        doc["notes"] += notes
        added = added or 0
        doc["target"].update(sent_fields=sorted(target.extra), prompt_tokens_added_by_server=added)
        too_short = [s for s in specs if s.prompt_len - added < 1]
        if too_short:
            raise WorkloadError(f"prompts must be longer than the {added} tokens the server adds "
                                f"(e.g. the chat template); request {too_short[0].index} asks for {too_short[0].prompt_len}")

        def prompts_for(batch: list[RequestSpec]) -> list[str]:
            # Fresh text every time: reusing prompts across rates would turn later rates into
            # prefix-cache hits and flatter them.
            return [builder.text(s.prompt_len - added) for s in batch]

        if args.warmup > 0:
            shapes = [specs[i % len(specs)] for i in range(args.warmup)]
            warm = [RequestSpec(-1 - i, s.prompt_len, s.output_len, "warmup") for i, s in enumerate(shapes)]
            _say(f"warm-up: {len(warm)} requests, not counted")
            try:
                results, _ = await run_schedule(warm, prompts_for(warm), [0.0] * len(warm), _sender(client, target),
                                                args.max_concurrency)
            except Interrupted:  # nothing measured yet: saved as an interrupted run with no rates
                raise asyncio.CancelledError from None
            bad = [r for r in results if not r.ok]
            if bad and len(bad) == len(results):
                raise BenchError(f"every warm-up request failed: {bad[0].error}")

        if args.request_rate is None:
            rates = [None] if kind == "trace" else [math.inf]
        else:
            rates = args.request_rate
        failed_any = False
        for rate in rates:
            rl = "trace" if rate is None else report.rate_label(rate)
            if rate is None:
                offsets = trace_offsets(specs)
            else:
                offsets = arrival_offsets(len(specs), rate, args.burstiness, args.seed)
            prompts = prompts_for(specs)
            breaker = ErrorBreaker(args.max_consecutive_errors)
            bar = report.progress(len(specs), f"{label} rate {rl}", args.progress)
            interrupted = False
            try:
                results, duration = await run_schedule(specs, prompts, offsets, _sender(client, target),
                                                       args.max_concurrency, lambda _r, b=bar: b.update(1), breaker)
            except Interrupted as e:
                results, duration, interrupted = e.results, e.duration_s, True
            finally:
                bar.close()
            summary = summarize(results, duration if duration > 0 else 1e-9, args.slo) if results else None
            run = {"rate": rate if rate is not None else _trace_rate(specs), "rate_label": rl,
                   "sent": len(results), "planned": len(specs), "summary": summary,
                   "by_kind": summarize_by_kind(results, duration, args.slo) if results and duration > 0 else {},
                   "results": results}
            doc["runs"].append(run)
            _save(args, doc)
            if summary is not None:
                print(report.format_summary(summary, f"{label} @ {rl} req/s"), flush=True)
                if run["by_kind"]:
                    print(report.format_by_kind(run["by_kind"]), flush=True)
            if interrupted:
                raise asyncio.CancelledError
            if breaker.tripped:
                raise BenchError(f"stopped at rate {rl}: the first {breaker.failed_in_row} requests all failed; "
                                 f"last error: {results[-1].error if results else 'none'}")
            failed_any |= any(not r.ok for r in results)

        runs = [r for r in doc["runs"] if r["summary"] is not None]
        if len(runs) > 1:
            print(report.format_sweep(runs), flush=True)
        if args.trace:
            print(report.AZURE_ATTRIBUTION, flush=True)
        if args.plot and runs:
            series = {label: runs}
            paths = [report.plot_latency_vs_rate(series, Path(args.plot) / "latency_vs_rate.png", label),
                     report.plot_cdfs(series, Path(args.plot) / "cdfs.png", label)]
            _say("plots: " + ", ".join(str(p) for p in paths))
        if args.output_json:
            _say(f"results: {args.output_json}")
        if failed_any:
            _say("some requests failed (see the errors above); exit status 1")
            return 1
        return 0


def _trace_rate(specs: list[RequestSpec]) -> float:
    span = (specs[-1].arrival_s or 0.0) - (specs[0].arrival_s or 0.0)
    return (len(specs) - 1) / span if span > 0 else math.inf


def _sender(client: httpx.AsyncClient, target: Target):
    run_t0 = time.perf_counter()

    async def send(spec: RequestSpec, prompt: str) -> RequestResult:
        return await stream_one(client, target, spec, prompt, run_t0)

    return send
