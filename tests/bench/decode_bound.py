"""Single-request decode against the memory-bandwidth bound (issue 17, point 3).

Each figure runs in its own subprocess (its own OpenMP runtime and thread settings), all on the
engine's defaults (`LLMEngine('smollm2')`: dtype auto, the runtime's thread count and wait policy):

  bound      the model's weight bytes that one decode step reads (every projection in the layout
             it is served from: fp32, or bf16 where dtype auto keeps the weights in bf16 for the
             AVX2 kernel; the head: its own copy, or the embedding table it is tied to; the norms;
             the embedding lookup reads one row, not counted) / the time of one read of a buffer
             that size on the engine's threads, best of 7 of each of three reads: `torch.sum`
             over it, and read_peak.c's loop of AVX512 loads (64-bit ones without AVX512; one
             contiguous part a thread, with and without a software prefetch); the bound is the
             fastest read's:
             tokens/s a step could reach if it did nothing but stream its weights once;
  decode     tokens/s of one greedy request, as engine_peers.py measures it: 128 / (time(256-token
             prompt + 129 tokens) - time(prompt + 1 token)), best of --repeats after a warm-up;
  neighbour  the same while another process spins on one of the CPUs the engine may use
             (`while True: pass`, pinned), so that "decode under a busy neighbour" is measured
             against the idle figure of the same run;
  paired     (--paired) one process taking turns: an engine step of the greedy request, then the
             bound's reads, for each of the request's 128 decode steps, --repeats requests; the
             medians of the step and of each read, and the ratio to the fastest read's. The read speed of a
             shared VM moves by a third within seconds (27-50 GB/s between reads a second apart
             here), so the bound's best-of-7 read and a best-of-N decode run seconds apart measure
             different machines; a pair a few ms apart measures one.

Each configuration runs with the runtime's default sleeping OpenMP waits, with them but every
step on all threads (the runner otherwise runs decode steps of a few sequences on one thread:
model_runner.py SMALL_DECODE_BATCH, a rule measured where a step took ~20 ms), and with a short
spin (GOMP_SPINCOUNT=10000), so the table shows what each buys on idle cores and costs beside a
busy neighbour. Ratios are taken between figures of the same run; the 1-minute load average is
kept beside each.

Usage: ~/.cache/phasesplit/venv/bin/python tests/bench/decode_bound.py [--repeats N] [--dtype D[,D2...]]
       [--json PATH]
(`--dtype auto,float32` puts the default beside plain fp32 weights in one run; ratios to the first
dtype's default row are printed at the end.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.engine_peers import DECODE_TOKENS, build_prompts, load1  # noqa: E402

READ_PEAK_C = Path(__file__).with_name("read_peak.c")
PREFETCH_BYTES = 1024  # read_peak.c's software prefetch distance, the variant that has one

# name -> (environment, whether small decode steps keep the runner's one-thread rule)
WAITS = {"passive": ({}, True),  # the default
         "passive-both-threads": ({}, False),  # every step on all threads, batch 1 included
         "spin": ({"GOMP_SPINCOUNT": "10000"}, True)}


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads, in the layouts they are served from."""
    from phasesplit.runtime.model.llama import Linear

    def size(t) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if model.tied_head is not None and model.tied_head not in linears:
        linears.append(model.tied_head)
    total = sum(size(m.weight) + size(m.tiled) + size(m.packed) + size(m.blocks and m.blocks.blocks)
                for m in linears)
    if model.lm_head is None and model.tied_head is None:  # the head reads the embedding table
        total += size(model.embed.weight)
    return total + sum(size(p) for n, p in model.named_parameters() if "norm" in n)


def read_kernel(tmp: Path) -> Callable[[object, int, int], int]:
    """read_peak.c built into `tmp`: read(tensor, threads, prefetch_distance) reads the tensor's
    bytes once and returns their checksum."""
    import ctypes

    lib_path = tmp / "read_peak.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-pthread", "-o", str(lib_path), str(READ_PEAK_C)], check=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.ps_read_bytes.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_long]
    lib.ps_read_bytes.restype = ctypes.c_uint64

    def read(t, threads: int, distance: int) -> int:
        return lib.ps_read_bytes(t.data_ptr(), t.numel() * t.element_size(), threads, distance)
    return read


def fastest_read(res: dict, read_s: dict[str, float], weight_bytes: int) -> None:
    """Each read's speed into res, and the fastest read's name and seconds (the bound's)."""
    res["reads_gb_s"] = {name: round(weight_bytes / t / 1e9, 1) for name, t in read_s.items()}
    res["read"] = min(read_s, key=read_s.get)
    res["read_s"] = read_s[res["read"]]
    res["gb_s"] = weight_bytes / res["read_s"] / 1e9


def worker(kind: str, dtype: str, repeats: int, out: Path, small_rule: bool) -> None:
    import torch

    from phasesplit.runtime import cpu_info
    from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
    from phasesplit.runtime.engine.model_runner import RunnerConfig
    from phasesplit.runtime.request import SamplingParams

    eng = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype=dtype, kv_cache_memory=1 << 30)))
    model = eng.runner.model
    if not small_rule:  # every step on all threads (model_runner.py's SMALL_DECODE_BATCH rule off)
        eng.runner.small_step_threads = None
    weight_bytes = step_weight_bytes(model)
    layouts = sorted({"bf16 weights" if m._bf16w else "" for m in model.modules() if hasattr(m, "_bf16w")} - {""})
    res: dict = {"kind": kind, "threads": eng.runner.threads,
                 "dtype": " ".join([str(next(model.parameters()).dtype)] + layouts),
                 "weight_bytes": weight_bytes, "load1_before": load1()}
    if kind != "bound":  # one greedy request's decode, after a warm-up
        prompts = build_prompts(repeats, seed=17)
        params = SamplingParams(max_tokens=DECODE_TOKENS + 1, temperature=0, ignore_eos=True)
        eng.generate(prompts["warmup"]["decode"][:1], params)
    if kind in ("bound", "paired"):  # a buffer of the weight bytes, read whole
        buf = torch.ones(weight_bytes // 4, dtype=torch.float32)
        c_read = read_kernel(out.parent)
        threads = eng.runner.threads
        loads = "AVX512 loads" if "avx512f" in cpu_info.flags() else "64-bit loads"  # read_peak.c's own choice
        reads = {"torch.sum": lambda: buf.sum(),
                 loads: lambda: c_read(buf, threads, 0),
                 f"{loads} + prefetch": lambda: c_read(buf, threads, PREFETCH_BYTES)}
    if kind == "bound":
        best = {}
        for _ in range(7):  # taking turns, so that a slow spell of the VM falls on every read
            for name, read in reads.items():
                t0 = time.perf_counter()
                read()
                best[name] = min(best.get(name, math.inf), time.perf_counter() - t0)
        fastest_read(res, best, weight_bytes)
        res["tok_s"] = 1.0 / res["read_s"]
    elif kind == "paired":
        steps, times = [], {name: [] for name in reads}
        for pair in prompts["decode"]:
            eng.add_request(f"paired-{len(steps)}", pair[1], params)
            eng.step()  # the prompt
            while eng.groups:
                t0 = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t0)
                for name, read in reads.items():
                    t0 = time.perf_counter()
                    read()
                    times[name].append(time.perf_counter() - t0)
        res["step_s"] = statistics.median(steps)
        fastest_read(res, {name: statistics.median(v) for name, v in times.items()}, weight_bytes)
        res["pairs"] = len(steps)
        res["ratio"] = res["read_s"] / res["step_s"]
        res["tok_s"] = 1.0 / res["step_s"]
    else:
        vals = []
        for pair in prompts["decode"]:
            t0 = time.perf_counter()
            eng.generate([pair[0]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            t1 = time.perf_counter() - t0
            t0 = time.perf_counter()
            n = sum(len(o) for o in eng.generate([pair[1]], params))
            t2 = time.perf_counter() - t0
            assert n == DECODE_TOKENS + 1, n
            vals.append(DECODE_TOKENS / (t2 - t1))
        res["runs"] = [round(v, 2) for v in vals]
        res["tok_s"] = max(vals)
    res["load1_after"] = load1()
    out.write_text(json.dumps(res))


def run(kind: str, env_extra: dict, small_rule: bool, dtype: str, repeats: int, neighbour: bool, tmp: Path) -> dict:
    out = tmp / f"{kind}-{len(env_extra)}-{int(small_rule)}-{int(neighbour)}.json"
    env = {**os.environ, **env_extra}
    with spinning_neighbour(neighbour):
        subprocess.run([sys.executable, __file__, "--worker", kind, "--dtype", dtype, "--repeats", str(repeats),
                        "--out", str(out)] + ([] if small_rule else ["--no-small-rule"]), env=env, check=True,
                       timeout=1800)
    return json.loads(out.read_text())


@contextlib.contextmanager
def spinning_neighbour(on: bool = True) -> Iterator[None]:
    """A busy neighbour for the block: another process spinning on the last CPU this one may use."""
    if not on:
        yield
        return
    cpu = sorted(os.sched_getaffinity(0))[-1]
    spinner = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto",
                    help="the engine's dtype, or several separated by commas, each a set of rows (auto: bf16 with "
                         "AVX512-BF16, else fp32 with bf16 projection weights where the AVX2 kernel runs)")
    ap.add_argument("--waits", default=",".join(WAITS),
                    help="which of the wait configurations to run (their names, separated by commas; default all)")
    ap.add_argument("--paired", action="store_true",
                    help="also the paired figure: engine steps and reads taking turns in one process")
    ap.add_argument("--json", type=Path, default=Path("/tmp/phasesplit-decode-bound.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--no-small-rule", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.dtype, a.repeats, a.out, not a.no_small_rule)
        return 0
    tmp = a.json.parent / (a.json.stem + ".d")
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype in a.dtype.split(","):
        for wait in a.waits.split(","):
            extra, small_rule = WAITS[wait]
            bound = run("bound", extra, True, dtype, a.repeats, False, tmp)
            idle = run("decode", extra, small_rule, dtype, a.repeats, False, tmp)
            busy = run("decode", extra, small_rule, dtype, a.repeats, True, tmp)
            paired = run("paired", extra, small_rule, dtype, a.repeats, False, tmp) if a.paired else None
            rows.append({"dtype": dtype, "wait": wait, "bound": bound, "idle": idle, "busy": busy, "paired": paired})
            print(f"--dtype {dtype}, {wait}: {bound['threads']} threads, {bound['dtype']}, "
                  f"{bound['weight_bytes'] / 1e6:.0f} MB of weights; reads (GB/s, best of 7) {bound['reads_gb_s']}: "
                  f"{bound['read']} {bound['gb_s']:.1f} GB/s -> bound {bound['tok_s']:.1f} tok/s "
                  f"(load {bound['load1_before']})", flush=True)
            print(f"  decode idle {idle['tok_s']:.1f} tok/s {idle['runs']} = {idle['tok_s'] / bound['tok_s']:.2f} x bound "
                  f"(load {idle['load1_before']}-{idle['load1_after']})", flush=True)
            print(f"  decode beside a spinning neighbour {busy['tok_s']:.1f} tok/s {busy['runs']} = "
                  f"{busy['tok_s'] / idle['tok_s']:.2f} x idle (load {busy['load1_before']}-{busy['load1_after']})",
                  flush=True)
            if paired:
                print(f"  paired, idle: median step {paired['step_s'] * 1e3:.2f} ms ({paired['tok_s']:.1f} tok/s), "
                      f"median reads (GB/s) {paired['reads_gb_s']}: {paired['read']} {paired['read_s'] * 1e3:.2f} ms "
                      f"over {paired['pairs']} pairs = {paired['ratio']:.2f} x bound "
                      f"(load {paired['load1_before']}-{paired['load1_after']})", flush=True)
    first = rows[0]
    for r in rows[1:]:
        print(f"--dtype {r['dtype']}, {r['wait']}: idle {r['idle']['tok_s'] / first['idle']['tok_s']:.2f} x, beside a "
              f"neighbour {r['busy']['tok_s'] / first['busy']['tok_s']:.2f} x (--dtype {first['dtype']}, {first['wait']})")
    a.json.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=1))
    print(f"raw: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
