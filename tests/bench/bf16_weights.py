"""bf16 weights with fp32 activations (cpu_gemm_avx2, dtype auto on AVX2 CPUs without AVX512-BF16)
against plain fp32 weights (`--dtype float32`, torch's matmul): per shape, then prefill.

  matmul   SmolLM2-135M's four projection shapes x 30 layers (distinct weights, so they come from
           memory as in a step) at 1, 4, 32 and 512 activation rows, one thread: the kernel on
           bf16 weights vs F.linear on fp32 weights (best of 5; 2 at 512 rows);
  prefill  tokens/s of the engine (`LLMEngine('smollm2')`, its default threads) on 512-token prompts
           of random words (engine_peers.build_prompts), best of --repeats after a warm-up, each dtype in its own
           process;
  step     the same engine's batch-1 decode step after a 256-token prompt, each of 100 steps timed
           on its own: median and 10th percentile (less sensitive to a shared machine's bursts than
           decode_bound.py's best-of-3 differences of whole runs).

The 1-minute load average is printed beside each figure.

Usage: ~/.cache/phasesplit/venv/bin/python tests/bench/bf16_weights.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.engine_peers import build_prompts, load1  # noqa: E402  (PREFILL_LEN-token prompts)

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o_proj, gate_up (SwiGLU), down
LAYERS = 30


def matmuls() -> None:
    import torch
    import torch.nn.functional as F

    from phasesplit.runtime.kernels import build, cpu_gemm_avx2

    lib = build.bf16w_library()
    if lib is None:
        print("the bf16-weight AVX2 kernel is unavailable here: no matmul rows")
        return
    fn = lib.ps_gemm_bf16w_f32
    g = torch.Generator().manual_seed(0)
    fp32 = [[torch.randn(n, k, generator=g) * k**-0.5 for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[cpu_gemm_avx2.pack(w, swiglu=i == 2) for i, w in enumerate(ws)] for ws in fp32]
    fp32_bytes = sum(n * k * 4 for n, k in SHAPES) * LAYERS

    def timed(m: int, kernel: bool) -> float:
        xs = [torch.randn(m, k, generator=g) for _, k in SHAPES]
        t0 = time.perf_counter()
        for ws, ps in zip(fp32, packed, strict=True):
            for i, (w, p, x) in enumerate(zip(ws, ps, xs, strict=True)):
                if kernel:
                    cpu_gemm_avx2.matmul(fn, x, p, SHAPES[i][0], act=cpu_gemm_avx2.SWIGLU if i == 2 else 0)
                else:
                    y = F.linear(x, w)
                    if i == 2:  # what the fp32 path does after gate_up
                        gate, up = y.chunk(2, dim=-1)
                        F.silu(gate) * up
        return time.perf_counter() - t0

    with build.num_threads(1):
        for m in (1, 4, 32, 512):
            reps = 5 if m < 512 else 2
            a = min(timed(m, False) for _ in range(reps))
            b = min(timed(m, True) for _ in range(reps))
            print(f"matmul {m:3d} rows, {LAYERS} layers, 1 thread: fp32 weights {a * 1e3:7.1f} ms "
                  f"({fp32_bytes / a / 1e9:.1f} GB/s), bf16 weights {b * 1e3:7.1f} ms ({fp32_bytes / 2 / b / 1e9:.1f} GB/s)"
                  f" = {a / b:.2f}x (load {load1()})", flush=True)


def prefill_worker(dtype: str, repeats: int) -> None:
    from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
    from phasesplit.runtime.engine.model_runner import RunnerConfig
    from phasesplit.runtime.request import SamplingParams

    eng = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype=dtype, kv_cache_memory=1 << 30)))
    prompts = build_prompts(repeats, seed=23)  # PREFILL_LEN tokens each, no shared first block
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng.generate(prompts["warmup"]["prefill"], params)
    vals, load = [], load1()
    for p in prompts["prefill"]:
        t0 = time.perf_counter()
        eng.generate([p], params)
        vals.append(len(p) / (time.perf_counter() - t0))
    eng.add_request("step", prompts["decode"][0][0], SamplingParams(max_tokens=110, temperature=0, ignore_eos=True))
    steps = []
    for _ in range(105):
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    steps = sorted(steps[5:])  # the prefill and the first steps left out
    print(json.dumps({"dtype": dtype, "tokens": len(prompts["prefill"][0]), "step_ms": [
                          round(steps[len(steps) // 2] * 1e3, 1), round(steps[len(steps) // 10] * 1e3, 1)], "threads": eng.runner.threads,
                      "tok_s": max(vals), "runs": [round(v) for v in vals], "load": [load, load1()]}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        prefill_worker(a.worker, a.repeats)
        return 0
    matmuls()
    for dtype in ("float32", "auto"):
        out = subprocess.run([sys.executable, __file__, "--worker", dtype, "--repeats", str(a.repeats)],
                             capture_output=True, text=True, check=True, timeout=1800)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"prefill --dtype {dtype}: {r['tokens']}-token prompt, {r['threads']} threads: {r['tok_s']:.0f} tok/s "
              f"{r['runs']}; batch-1 decode step median {r['step_ms'][0]} ms ({1e3 / r['step_ms'][0]:.1f} tok/s), "
              f"10th percentile {r['step_ms'][1]} ms (load {r['load'][0]}-{r['load'][1]})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
