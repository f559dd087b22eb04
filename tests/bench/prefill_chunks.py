"""What a prompt chunk costs: one long prompt prefilled in chunks of each size, against the whole
token budget in the same run, and what the engine's fitted step cost says the same chunks cost.

The chunk cap (EngineConfig.chunk_overhead, the server's --chunk-overhead) assumes a step costs
base + per_token x tokens, and cuts chunks where base is a given share of the step. This checks
that assumption where it matters, on the engine's own steps: prefill time of a --prompt-len
prompt at max_num_batched_tokens = each of --chunks, divided by its time at the largest, next to
the overhead the fit predicts (steps x base + tokens x per_token, over one step of all of them).

Usage: ~/.cache/phasesplit/venv/bin/python tests/bench/prefill_chunks.py [--prompt-len 1024]
       [--chunks 32,64,128,256,512] [--threads N] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--chunks", default="32,64,128,256,512")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
    from phasesplit.runtime.engine.model_runner import RunnerConfig
    from phasesplit.runtime.engine.step_costs import efficient_chunk
    from phasesplit.runtime.request import SamplingParams

    chunks = sorted(int(c) for c in a.chunks.split(","))
    eng = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(kv_cache_memory=256 << 20, threads=a.threads),
                                            max_num_batched_tokens=max(chunks), prefix_caching=False))
    vocab = eng.tokenizer.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    seed = 0

    def prompt() -> list[int]:  # never the same text twice: no cache helps (prefix caching is off too)
        nonlocal seed
        seed += 1
        return [(seed * 7919 + i * 104729) % (vocab - 100) + 50 for i in range(a.prompt_len)]

    eng.generate([prompt()], one)  # warm-up
    times: dict[int, float] = {}
    for _ in range(a.repeats):  # chunk sizes interleaved within each repeat: drift hits them alike
        for c in chunks:
            eng.scheduler.budget = c
            t0 = time.perf_counter()
            eng.generate([prompt()], one)
            times[c] = min(times.get(c, math.inf), time.perf_counter() - t0)
    base, per_token = eng.prompt_step_fit()
    big = max(chunks)
    print(f"{a.prompt_len}-token prompt, threads {eng.runner.threads}, dtype {str(eng.runner.dtype)[6:]}, "
          f"load {os.getloadavg()[0]:.2f}; fitted prompt step: {base * 1e3:.1f} ms + {per_token * 1e3:.3f} ms/token")
    print(f"{'chunk':>6} {'prefill s':>10} {'/ chunk ' + str(big):>12} {'fit predicts':>13}")
    for c in chunks:
        steps, steps_big = math.ceil(a.prompt_len / c), math.ceil(a.prompt_len / big)
        predicted = (steps * base + a.prompt_len * per_token) / (steps_big * base + a.prompt_len * per_token)
        print(f"{c:>6} {times[c]:>10.3f} {times[c] / times[big]:>11.3f}x {predicted:>12.3f}x")
    for share in (0.05, 0.1):
        print(f"efficient chunk at a {share:.0%} fixed-cost share: {efficient_chunk(base, per_token, share)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
