"""How decode steps use the second core, measured: steps of 1-32 sequences, offline throughput and
single-request decode, on idle cores and beside a busy neighbour, for each setting, in one run.

A decode step of the native bf16 path is one C call (cpu_decode_step.py), but it runs ~240
kernels (30 layers of projections, norm, RoPE, attention), and the second core joins each one
either as an OpenMP region or through the decode helpers (kernels/decode_helpers.c). The settings:

  small      the rule before 2026-12-06: steps of up to 2 sequences on one thread with the
             helpers, bigger ones in OpenMP regions with sleeping waits (OMP_WAIT_POLICY=PASSIVE:
             every region wakes its team with a futex, tens of microseconds in a VM)
             [PHASESPLIT_DECODE_HELPERS=small];
  helpers    the default: every one-call step (up to 64 sequences) on one thread, its matmuls and
             attention shared with the helpers (they spin 200 us, then sleep; the caller takes back
             work a descheduled helper holds);
  spinN      OpenMP regions for every step, threads spinning N pause loops (~25 ns each on a Zen 4)
             before they sleep [GOMP_SPINCOUNT=N]: no wake-ups between back-to-back regions, but a
             descheduled thread holds up each region it is part of.

Each setting runs in its own subprocess (libgomp reads the environment once), with the engine as
engine_peers.py configures it:

  batch B    tokens/s of a decode step of B sequences (the median step while B requests of
             128-token prompts decode 64 tokens together);
  offline    32 requests x 256-token prompts x 128 tokens, submitted at once: output tokens/s;
  decode     one greedy request: 128 / (time(256-token prompt + 129 tokens) - time(prompt + 1 token));
  neighbour  all of it again while another process spins on the last CPU the engine may use.

Offline and decode are the best of --repeats. Ratios are to the first setting (--settings) in the
same condition of the same run.

Usage: ~/.cache/phasesplit/venv/bin/python tests/bench/decode_threads.py [--settings small,helpers,spin1000]
       [--batches 1,4,8,16,32] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.decode_bound import spinning_neighbour  # noqa: E402
from tests.bench.engine_peers import DECODE_TOKENS, N_REQ, OUT_LEN, build_prompts, load1  # noqa: E402

VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PHASESPLIT_DECODE_HELPERS")


def setting_env(name: str) -> dict[str, str]:
    if name == "small":
        return {"OMP_WAIT_POLICY": "PASSIVE", "PHASESPLIT_DECODE_HELPERS": "small"}
    if name == "helpers":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if name.startswith("spin") and name[4:].isdigit():
        return {"GOMP_SPINCOUNT": name[4:]}
    raise SystemExit(f"unknown setting {name!r} (small, helpers, spinN)")


def worker(batches: list[int], repeats: int, out: Path) -> None:
    from phasesplit.runtime.engine import engine as engine_mod
    from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
    from phasesplit.runtime.engine.model_runner import RunnerConfig
    from phasesplit.runtime.request import SamplingParams

    steps: list[float] = []
    step = engine_mod.LLMEngine.step

    def timed(self, *a, **k):  # the engine's own step, timed
        t0 = time.perf_counter()
        r = step(self, *a, **k)
        steps.append(time.perf_counter() - t0)
        return r

    engine_mod.LLMEngine.step = timed
    eng = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(kv_cache_memory=1 << 30), max_num_seqs=64,
                                            max_num_batched_tokens=2048))
    prompts = build_prompts(repeats, seed=29)
    res: dict = {"env": {k: os.environ.get(k) for k in VARS}, "threads": eng.runner.threads,
                 "decode_helpers": eng.runner.decode_helpers, "dtype": str(eng.runner.dtype).removeprefix("torch."),
                 "load1_before": load1()}
    greedy = dict(temperature=0, ignore_eos=True)
    eng.generate(prompts["warmup"]["offline"], SamplingParams(max_tokens=8, **greedy))
    res["batch"] = {}
    pool = [p[:128] for batch in prompts["offline"] for p in batch]  # 128-token prompts, unseen so far
    for b in batches:
        group, pool = pool[:b], pool[b:] + pool[:b]
        steps.clear()
        eng.generate(group, SamplingParams(max_tokens=65, **greedy))
        res["batch"][b] = round(b / statistics.median(steps[-60:]), 1)  # decode steps only (the last 60)
    off = SamplingParams(max_tokens=OUT_LEN, **greedy)
    runs = []
    for batch in prompts["offline"]:
        t0 = time.perf_counter()
        n = sum(len(o) for o in eng.generate(batch, off))
        runs.append(n / (time.perf_counter() - t0))
        assert n == N_REQ * OUT_LEN, n
    res["offline"] = [round(v, 1) for v in runs]
    one = SamplingParams(max_tokens=1, **greedy)
    dec = SamplingParams(max_tokens=DECODE_TOKENS + 1, **greedy)
    eng.generate(prompts["warmup"]["decode"][:1], dec)
    runs = []
    for first, second in prompts["decode"]:
        t0 = time.perf_counter()
        eng.generate([first], one)
        t1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        eng.generate([second], dec)
        runs.append(DECODE_TOKENS / (time.perf_counter() - t0 - t1))
    res["decode"] = [round(v, 1) for v in runs]
    res["load1_after"] = load1()
    out.write_text(json.dumps(res))


def run(name: str, neighbour: bool, batches: str, repeats: int, tmp: Path) -> dict:
    out = tmp / f"{name}-{int(neighbour)}.json"
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(setting_env(name))
    with spinning_neighbour(neighbour):
        subprocess.run([sys.executable, __file__, "--worker", "--batches", batches, "--repeats", str(repeats),
                        "--out", str(out)], env=env, check=True, timeout=1800)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="small,helpers,spin1000")
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "phasesplit-decode-threads.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.worker:
        worker(batches, a.repeats, a.out)
        return 0
    names = a.settings.split(",")
    for name in names:
        setting_env(name)  # refuse a bad name before the first run
    results: dict[str, dict[str, dict]] = {}
    noted = False
    with tempfile.TemporaryDirectory() as d:
        for neighbour in (False, True):
            where = "beside a spinning neighbour" if neighbour else "idle"
            for name in names:
                r = run(name, neighbour, a.batches, a.repeats, Path(d))
                results.setdefault(name, {})[where] = r
                if r["dtype"] != "bfloat16" and not noted:
                    noted = True  # the rule this compares is the native bf16 path's
                    print(f"note: dtype auto is {r['dtype']} on this CPU (no AVX512-BF16): 'small' and 'helpers' "
                          "run the same rule here, only the spinN settings differ", flush=True)
                sweep = " ".join(f"b{b} {v:.0f}" for b, v in r["batch"].items())
                print(f"{name:>9} {where}: steps tok/s {sweep}; offline {max(r['offline']):.1f} {r['offline']}; "
                      f"decode {max(r['decode']):.1f} {r['decode']} (load {r['load1_before']:.2f}-"
                      f"{r['load1_after']:.2f}, helpers {r['decode_helpers']})", flush=True)
    base = names[0]
    print(f"\nratios to {base} in the same condition:")
    for name in names[1:]:
        for where, r in results[name].items():
            b = results[base][where]
            sweep = " ".join(f"b{k} {v / b['batch'][k]:.2f}x" for k, v in r["batch"].items())
            print(f"  {name:>9} {where}: steps {sweep}; offline {max(r['offline']) / max(b['offline']):.2f}x; "
                  f"decode {max(r['decode']) / max(b['decode']):.2f}x")
    a.json.write_text(json.dumps(results, indent=1))
    print(f"raw: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
