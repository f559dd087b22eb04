"""The CUDA path on a GPU: a prepared check for a lent device machine (CI has no GPU).

For the bundled model it prints:
  tokens      greedy tokens (8 prompts x 32) of CUDA fp32 and CUDA bf16, CUDA graphs on and off,
              against the CPU fp32 reference under the tie rule of tests/greedy.py (equal, or a
              first divergence where the reference's top-2 margin is within the path's precision);
              graphs on against graphs off; a batched run against the one-at-a-time run;
  graphs      whether decode graphs stayed on (their first replay of each bucket is checked
              against eager in cuda_graphs.py) and how many buckets were captured;
  quantized   what a GGUF-block request does on CUDA (dequantized at load, with a log line);
  speed       single-request decode tok/s (128 / (time(256-token prompt + 129) - time(prompt + 1)),
              best of 3) and offline throughput (32 x 256 in / 128 out, output tok/s), graphs on
              and off, in the same run.

Exits 1 if any comparison fails, after printing everything.

Usage: python tests/bench/cuda_check.py [--json PATH] [--device cpu]
(`--device cpu` runs the same steps on the CPU: a dry run of this script where there is no GPU.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from phasesplit.runtime.engine.model_runner import RunnerConfig  # noqa: E402
from phasesplit.runtime.model.loader import resolve  # noqa: E402
from phasesplit.runtime.model.tokenizer import TextTokenizer  # noqa: E402
from phasesplit.runtime.request import SamplingParams  # noqa: E402
from tests.greedy import compare, greedy_with_top2  # noqa: E402
from tests.prompts import all_prompt_ids  # noqa: E402

NEW_TOKENS = 32
PROMPTS = 8
# bf16 against fp32: the bound tests/integration/test_bf16_weights.py uses for bf16 weights.
BF16_MARGIN_MOVE = 0.5
FP32_MARGIN_MOVE = 0.05


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def engine(device: str, dtype: str, graphs: bool = True, quantization: str = "none") -> LLMEngine:
    os.environ["PHASESPLIT_CUDA_GRAPHS"] = "1" if graphs else "0"
    return LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(device=device, dtype=dtype, quantization=quantization,
                                                                 kv_cache_memory=2 << 30, max_model_len=2048)))


def graphs_state(eng: LLMEngine) -> str:
    g = eng.runner.graphs
    if g is None:
        return "off (not used)"
    return f"{'on' if g.enabled else 'TURNED OFF'}, {len(g.graphs)} bucket(s) captured: {sorted(g.graphs)}"


def checked(failures: list[str], name: str, ref, got, margin: float) -> None:
    try:
        compare(name, ref, got, NEW_TOKENS, margin)
    except AssertionError as e:
        failures.append(f"{name}: {e}")
        print(f"FAIL {name}: {e}")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_tps(eng: LLMEngine, repeats: int = 3) -> float:
    rng = random.Random(0)
    prompt = [rng.randrange(100, 20000) for _ in range(256)]

    def timed(n: int) -> float:
        p = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
        sync()
        t = time.perf_counter()
        eng.generate([prompt], p)
        sync()
        return time.perf_counter() - t

    timed(8)  # warm-up (graph capture of the buckets on the way)
    timed(129)
    return max(128 / (timed(129) - timed(1)) for _ in range(repeats))


def offline_tps(eng: LLMEngine) -> float:
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 20000) for _ in range(256)] for _ in range(32)]
    p = SamplingParams(max_tokens=128, min_tokens=128, temperature=0, ignore_eos=True)
    eng.generate(prompts[:4], SamplingParams(max_tokens=16, min_tokens=16, temperature=0, ignore_eos=True))
    sync()
    t = time.perf_counter()
    out = eng.generate(prompts, p)
    sync()
    return sum(map(len, out)) / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 2
    log = Captured()
    logging.getLogger("phasesplit").addHandler(log)
    logging.getLogger("phasesplit").setLevel(logging.INFO)
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "CPU (dry run)"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {name}", flush=True)
    prompts = all_prompt_ids(TextTokenizer(resolve("smollm2").folder))[:PROMPTS]
    failures: list[str] = []
    report: dict = {"device": name, "torch": torch.__version__}

    t = time.perf_counter()
    cpu = engine("cpu", "float32")
    ref = greedy_with_top2(cpu, prompts, NEW_TOKENS)
    del cpu
    print(f"CPU fp32 reference: {time.perf_counter() - t:.1f}s", flush=True)

    runs = {}
    for name, dtype, graphs, margin in (("cuda fp32 graphs", "float32", True, FP32_MARGIN_MOVE),
                                        ("cuda bf16 graphs", "auto", True, BF16_MARGIN_MOVE),
                                        ("cuda bf16 eager", "auto", False, BF16_MARGIN_MOVE)):
        t = time.perf_counter()
        eng = engine(dev, dtype, graphs)
        got = greedy_with_top2(eng, prompts, NEW_TOKENS)
        print(f"{name}: dtype {eng.runner.dtype}, graphs {graphs_state(eng)}, {time.perf_counter() - t:.1f}s",
              flush=True)
        report[f"{name} graphs"] = graphs_state(eng)
        if dev == "cuda" and graphs and (eng.runner.graphs is None or not eng.runner.graphs.enabled):
            failures.append(f"{name}: CUDA graphs did not stay on")
        checked(failures, f"{name} vs CPU fp32", ref, got, margin)
        if dtype == "auto" and graphs:
            batched = eng.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                                                           temperature=0))
            same = sum(b == g[0] for b, g in zip(batched, got, strict=True))
            print(f"{name}: batched run of {PROMPTS} equals one-at-a-time on {same}/{PROMPTS} prompts; "
                  f"graphs {graphs_state(eng)}", flush=True)
            report["bf16 batched equal"] = same
        runs[name] = got
        del eng
        if dev == "cuda":
            torch.cuda.empty_cache()
    checked(failures, "cuda bf16 graphs vs eager", runs["cuda bf16 eager"], runs["cuda bf16 graphs"],
            BF16_MARGIN_MOVE)

    log.lines.clear()
    eng = engine(dev, "auto", True, quantization="auto")
    note = [line for line in log.lines if "dequantized" in line or "quantiz" in line]
    print(f"--quantization auto on CUDA: {note or 'NO LOG LINE'}", flush=True)
    if not note:
        failures.append("GGUF blocks on CUDA: no log line says what was done")
    checked(failures, "cuda bf16 quantization=auto vs CPU fp32", ref, greedy_with_top2(eng, prompts, NEW_TOKENS),
            BF16_MARGIN_MOVE)
    del eng
    if dev == "cuda":
        torch.cuda.empty_cache()

    speed = {}
    for graphs in (True, False):
        eng = engine(dev, "auto", graphs)
        d, o = decode_tps(eng), offline_tps(eng)
        speed["graphs" if graphs else "eager"] = {"decode_tok_s": round(d, 1), "offline_tok_s": round(o, 1)}
        print(f"bf16 {'graphs' if graphs else 'eager'}: single-request decode {d:.1f} tok/s, "
              f"offline 32x256/128 {o:.1f} output tok/s; graphs {graphs_state(eng)}", flush=True)
        del eng
        if dev == "cuda":
            torch.cuda.empty_cache()
    g, e = speed["graphs"], speed["eager"]
    print(f"graphs / eager: decode {g['decode_tok_s'] / e['decode_tok_s']:.2f}x, "
          f"offline {g['offline_tok_s'] / e['offline_tok_s']:.2f}x")
    report["speed"] = speed
    report["failures"] = failures
    warnings = [line for line in log.lines if "turned off" in line or "differs" in line]
    if warnings:
        print("warnings:", *warnings, sep="\n  ")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print("FAILURES:" if failures else "all comparisons passed", *failures, sep="\n  ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
