"""Per-token cost of a grammar-constrained request in a mixed batch vs a free one.

    ~/.cache/phasesplit/venv/bin/python tests/bench/constrained_batch.py [--steps 48] [--repeat 3]

Runs the engine in this process (no HTTP) with a decode batch of 16 requests: first all 16 free,
then 8 constrained by JSON schemas (arrays of tests/data/json_schemas.json's objects) plus 8 free,
all greedy. It times the decode steps only (after every prompt is in). A free
request's per-token cost is step_time_all_free / 16; a constrained one's is that plus its share of
what the mixed batch adds: (step_mixed - step_all_free) / 8. Prints both and the overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.grammar import spec
from phasesplit.runtime.request import SamplingParams

SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "data" / "json_schemas.json").read_text())
BATCH = 16


def decode_step_time(engine: LLMEngine, constrained: int, steps: int, tag: str) -> float:
    tok = engine.tokenizer
    for i in range(BATCH):
        s = SCHEMAS[i % len(SCHEMAS)]
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Give me an example {s['name']} "
                                                   f"as JSON, request {i}."}]))
        # An array of the test schema's objects: the same masks, and long enough that no
        # constrained request completes its document within the timed steps.
        long_doc = {"type": "array", "items": s["schema"], "minItems": 64, "maxItems": 64}
        guided = spec("json", long_doc, "guided_json") if i < constrained else None
        # Long enough for every request to still be decoding when the timed steps end.
        engine.add_request(f"{tag}-{i}", ids, SamplingParams(max_tokens=steps + 8, temperature=0, guided=guided))
    while any(len(s.output_ids) == 0 for s in engine.seqs.values()):  # prompts in, first tokens out
        engine.step()
    times = []
    for _ in range(steps):
        running = len(engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        if running == BATCH:
            times.append(time.perf_counter() - t0)
    for i in range(BATCH):
        engine.abort(f"{tag}-{i}")
    assert len(times) >= steps // 2, "requests ended early; the timed steps must be full batches"
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from phasesplit.runtime.engine.model_runner import RunnerConfig

    engine = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype=args.dtype, kv_cache_memory=256 << 20)))
    engine.grammars  # noqa: B018 - set up the vocabulary before timing
    free, mixed = [], []
    for r in range(args.repeat):  # interleaved, so drift in machine load hits both alike
        free.append(decode_step_time(engine, 0, args.steps, f"free{r}"))
        mixed.append(decode_step_time(engine, BATCH // 2, args.steps, f"mixed{r}"))
    t_free, t_mixed = statistics.median(free), statistics.median(mixed)
    per_free = t_free / BATCH
    # Signed: within noise the mixed batch can time faster than the free one; hiding that would
    # make the figure look more certain than it is.
    per_constrained = per_free + (t_mixed - t_free) / (BATCH // 2)
    print(f"device {engine.runner.device}, dtype {engine.runner.dtype}, batch {BATCH}, {args.steps} decode steps x "
          f"{args.repeat}")
    print(f"step: all free {t_free * 1e3:.2f} ms, 8 constrained + 8 free {t_mixed * 1e3:.2f} ms")
    print(f"per token: free {per_free * 1e3:.3f} ms, constrained {per_constrained * 1e3:.3f} ms "
          f"({(per_constrained / per_free - 1) * 100:+.1f} %)")
    print("step times (ms), free:", " ".join(f"{t * 1e3:.1f}" for t in free), "| mixed:",
          " ".join(f"{t * 1e3:.1f}" for t in mixed))


if __name__ == "__main__":
    main()
