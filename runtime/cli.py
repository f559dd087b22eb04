"""The `phasesplit` command line.

`phasesplit serve` is the contract between the operator and the runtime: the operator renders
container args that this parser must accept (tests/unit/test_contract.py checks it). Keep flags
backwards compatible; add, do not rename.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from phasesplit.runtime.disagg.placement import MODES as PLACEMENT_MODES  # pure, import-light
from phasesplit.runtime.engine.step_costs import CHUNK_OVERHEAD  # pure, import-light

ROLES = ("both", "prefill", "decode", "router")
FAILURE_POLICIES = ("retry", "local", "fail", "retry-local")  # runtime/disagg/decode.py applies them


def parse_bytes(text: str) -> int:
    """Parse a memory size: plain bytes, or with a unit (KiB, MiB, GiB, KB, MB, GB, Ki, Mi, Gi)."""
    units = {
        "": 1, "b": 1,
        "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
        "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
        "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    }
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):].strip()
    if unit not in units or not num:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (use e.g. 2GiB, 512MiB, 1000000)")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be positive: {text!r}")
    return int(value * units[unit])


def parse_seconds(text: str, allow_zero: bool = False) -> float:
    """A duration flag: plain seconds or with units (500ms, 30s, 1m30s); see phasesplit.runtime.units."""
    from phasesplit.runtime.units import parse_duration

    try:
        return parse_duration(text, bare_unit="s", allow_zero=allow_zero)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seconds_or_zero(text: str) -> float:
    """A duration flag where 0 means "off"."""
    return parse_seconds(text, allow_zero=True)


def cpu_list(text: str) -> tuple[int, ...]:
    """'1', '0,2' or '2-3' (taskset's list form) -> sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list (e.g. 1, 0,2 or 2-3)")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cpus))


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _share(text: str) -> float:
    """A fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1: {text!r}")
    return value


def _url_list(text: str) -> list[str]:
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags that pick and size the model; shared by `serve` and `up`."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default="smollm2",
                   help="'smollm2' (the bundled GGUF), a .gguf file, or a Hugging Face directory")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) clients use in the API (default: derived from --model); the --model "
                        "value is always accepted too")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="auto: bfloat16 on CUDA and on CPUs with AVX512-BF16, else float32 with the "
                        "projections' weights in bfloat16 on AVX2 CPUs (float32: all weights float32)")
    g.add_argument("--quantization", choices=("none", "auto", "q8_0", "q4_0", "q4_1"), default="none",
                   help="none: dequantize a GGUF's weights at load (the reference); auto, or the file's type "
                        "named: serve Q8_0/Q4_0/Q4_1 projections in their blocks through the CPU kernels "
                        "(falls back to none, with a log line, where those cannot run; docs/engine.md)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the model's)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="bytes for the KV cache, e.g. 2GiB (default: --kv-cache-fraction of free memory, at most 1GiB on CPU)")
    g.add_argument("--kv-cache-fraction", type=float, default=0.3,
                   help="fraction of free device memory for the KV cache when --kv-cache-memory is unset")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests in the running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one engine step (prefill chunks are cut to fit)")
    g.add_argument("--chunk-overhead", type=_share, default=CHUNK_OVERHEAD, metavar="SHARE",
                   help="cap every step's prompt tokens where the step's fixed cost (measured) is this share "
                        f"of it: chunks no longer than pays for itself, so a short prompt or a stream beside a "
                        f"long one waits less (default {CHUNK_OVERHEAD}; 0: chunks fill --max-num-batched-tokens)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="turn off prefix caching")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch, per tensor-parallel rank (default: the allowed CPUs / ranks)")
    g.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="split the model over N processes (one per GPU on CUDA; gloo on CPU): attention by "
                        "KV-head groups, the MLP by columns (docs/engine.md)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=ROLES, default="both",
                   help="both: colocated; prefill/decode: one phase; router: the OpenAI front end")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_model_args(p)
    p.add_argument("--borrow-idle-cpus", type=cpu_list, default=(), metavar="CPUS",
                   help="CPUs other workers own (e.g. 1 or 2-3): with --threads 1, this worker shares its "
                        "matmuls with an idle-priority helper on each, which runs only while that CPU would idle "
                        "(phasesplit up --pin-cpus gives each worker the others')")
    g = p.add_argument_group("phase split")
    g.add_argument("--kv-port", type=int, default=0,
                   help="decode worker: TCP port that receives KV blocks (0: a free port)")
    g.add_argument("--kv-host", default=None,
                   help="decode worker: address prefill workers use to reach the KV port (default: --host)")
    g.add_argument("--prefill-urls", type=_url_list, default=[],
                   help="router/decode: comma-separated prefill worker URLs")
    g.add_argument("--decode-urls", type=_url_list, default=[],
                   help="router: comma-separated decode worker URLs")
    g.add_argument("--discovery", choices=("static", "kubernetes"), default="static",
                   help="router: workers from flags, or from the ready endpoints of Kubernetes Services")
    g.add_argument("--namespace", default=None, help="router: namespace of the phase Services")
    g.add_argument("--prefill-service", default=None,
                   help="router: headless Service of prefill workers (discovery); decode: its DNS name, whose "
                        "addresses are the prefill workers this worker may call")
    g.add_argument("--decode-service", default=None, help="router: headless Service of decode workers")
    g.add_argument("--on-prefill-failure", choices=FAILURE_POLICIES, default="retry-local",
                   help="decode worker: what to do when a prefill worker fails or times out")
    g.add_argument("--prefill-timeout", type=parse_seconds, default=30.0,
                   help="decode worker: seconds to wait for a remote prefill")
    g.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="decode worker: prompts of at most this many uncached tokens are prefilled locally, "
                        "whatever --prefill-placement decides (an override)")
    g.add_argument("--prefill-placement", choices=PLACEMENT_MODES, default="static",
                   help="decode worker: where the other prompts are prefilled. static: on a prefill worker; "
                        "adaptive: here or there, whichever gives the first token sooner without a step here "
                        "outgrowing --itl-target, from measured step costs and the prefill queue")
    g.add_argument("--itl-target", type=seconds_or_zero, default=0.1,
                   help="decode worker, adaptive placement: the longest step a local prefill may make; "
                        "prompt chunks beside running streams are cut to fit it (0: no limit)")
    g.add_argument("--pause-for-remote-prefill", action="store_true",
                   help="decode worker whose prefill workers borrow its CPU (--borrow-idle-cpus; up --pin-cpus "
                        "sets it): leave that CPU to a short remote prefill of its own while its one or two "
                        "streams are ahead of --itl-target's pace, in pauses between steps that keep each gap between "
                        "two tokens within the target")
    g.add_argument("--drain-timeout", type=parse_seconds, default=300.0,
                   help="on SIGTERM: how long to let requests in flight finish before exiting")
    g.add_argument("--revision", default="",
                   help="prefill/decode worker: its revision (the operator's hash of model, dtype, block size, "
                        "image and args); the router pairs a decode worker only with prefill workers of the same one")
    g.add_argument("--api-key-env", default="PHASESPLIT_API_KEY",
                   help="router/colocated: env var holding the API key clients must send (unset: no auth; "
                        "set but empty: refuses to start)")
    g = p.add_argument_group("admission (beyond these limits a request gets 429 with Retry-After)")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests a worker holds beyond its running batch (default: 4 x --max-num-seqs); "
                        "the router admits this plus --max-num-seqs per live decode worker")
    g.add_argument("--max-queued-tokens", type=int, default=None,
                   help="prompt tokens a worker holds beyond what its KV cache fits (default: 4 x the KV "
                        "cache's tokens)")
    g.add_argument("--max-body-bytes", type=parse_bytes, default=4 * 1024 * 1024,
                   help="largest request body; bigger ones get 413")
    g.add_argument("--max-held", type=positive_int, default=256,
                   help="router: requests held at once while no worker of a phase they need is up (a phase "
                        "scaled to zero, or not ready yet); more get 429")
    g.add_argument("--hold-timeout", type=seconds_or_zero, default=30.0,
                   help="router: how long a held request waits for a worker before it gets 503 with "
                        "Retry-After (0: never hold)")
    g.add_argument("--hold-for-prefill", action="store_true",
                   help="router: hold requests while no prefill worker is up too (the decode workers may not "
                        "prefill them; the operator sets it when prefill scales to zero)")
    g.add_argument("--lend-idle-prefill", action="store_true",
                   help="router: send a whole request (prefill and decode) to a prefill worker with nothing to "
                        "prefill when it carries two requests fewer than the best decode worker and that worker's "
                        "next step nears its ITL target (40 %% of it, where it reports both), so a decode-heavy "
                        "mix decodes on every core (those streams share the prefill worker's steps with its "
                        "remote prefills, as colocated streams do)")
    g.add_argument("--worker-poll-interval", type=parse_seconds, default=0.5,
                   help="router: how often it reads each worker's state (load, KV blocks, readiness); a "
                        "worker that went away meanwhile is found by the first request that cannot reach "
                        "it, which then waits for another")
    g.add_argument("--worker-read-timeout", type=parse_seconds, default=30.0,
                   help="router: seconds a decode worker may stay silent mid-request (it sends a keepalive "
                        "line every 2 s while a request waits) before the request fails and the worker is "
                        "marked down")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasesplit", description="Phase-split LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one runtime role (a pod's entry point)")
    add_serve_args(serve)

    up = sub.add_parser("up", help="run router + prefill + decode locally as child processes")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000, help="router port")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    up.add_argument("--decode", type=int, default=1, help="number of decode workers")
    up.add_argument("--colocated", type=positive_int, nargs="?", const=1, default=0, metavar="N",
                    help="colocated workers instead of a split: one 'both' worker (N=1, the default), or N "
                         "replicas behind the router, each prefilling its own requests (with --pin-cpus, "
                         "each on its share of the cores)")
    up.add_argument("--pin-cpus", action="store_true",
                    help="pin each worker to its own CPU cores; a worker of one core also borrows the others' "
                         "while they idle (--borrow-idle-cpus)")
    up.add_argument("--no-borrow-idle-cpus", dest="borrow_idle_cpus", action="store_false",
                    help="with --pin-cpus: each worker computes on its own cores only (for A/B runs)")
    up.add_argument("--no-pause-for-remote-prefill", dest="pause_for_remote_prefill", action="store_false",
                    help="with --pin-cpus: decode workers never leave their CPU to a remote prefill (for A/B runs)")
    up.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    up.add_argument("--on-prefill-failure", choices=FAILURE_POLICIES, default="retry-local")
    up.add_argument("--prefill-timeout", type=parse_seconds, default=30.0)
    up.add_argument("--local-prefill-threshold", type=int, default=0)
    up.add_argument("--prefill-placement", choices=PLACEMENT_MODES, default="static")
    up.add_argument("--itl-target", type=seconds_or_zero, default=0.1)
    up.add_argument("--lend-idle-prefill", dest="lend_idle_prefill", action="store_true", default=None,
                    help="with --prefill-placement adaptive: the router lends idle prefill workers whole "
                         "requests (the default, except where --pin-cpus workers borrow each other's cores: "
                         "there the decode worker's steps run on the idle prefill core instead)")
    up.add_argument("--no-lend-idle-prefill", dest="lend_idle_prefill", action="store_false",
                    help="with --prefill-placement adaptive: keep whole requests off the prefill workers")
    up.add_argument("--drain-timeout", type=parse_seconds, default=300.0,
                    help="on Ctrl-C: how long each worker may take to finish its requests")
    add_model_args(up)

    # Other subcommands register their own flags. Their cli modules import only argparse at
    # module level (heavy imports go inside run()) so that `serve` stays fast to start. They
    # ship in the same package: a failing import is a bug, raised, not a subcommand dropped.
    for name, module, help_text in _PLUGINS:
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_text))
    return parser


# (subcommand, module with add_arguments(parser) and run(args) -> int, help)
_PLUGINS = [
    ("operator", "phasesplit.operator.cli", "run the Kubernetes operator"),
    ("bench", "phasesplit.runtime.bench.cli", "benchmark any OpenAI-compatible endpoint"),
    ("sim", "phasesplit.operator.sim.cli", "replay a workload through the autoscaler in simulated time"),
]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from phasesplit.runtime.server.launch import serve

        return serve(args)
    if args.command == "up":
        from phasesplit.runtime.up import up

        return up(args)
    for name, module, _ in _PLUGINS:
        if args.command == name:
            return importlib.import_module(module).run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
