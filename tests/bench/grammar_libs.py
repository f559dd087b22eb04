"""CPU cost per token of the two grammar libraries on this model's vocabulary (SmolLM2, 49152 tokens).

For each of the ten test schemas (tests/data/json_schemas.json) a valid document is tokenized with
the model's tokenizer and replayed through each library: per token, compute the next-token bitmask
and accept the token, which is what a constrained request costs the sampler per step. Also prints
the one-off costs (tokenizer set-up, schema compilation).

Usage: python tests/bench/grammar_libs.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data" / "json_schemas.json"

EXAMPLES = {
    "person": {"name": "Alice Smith", "age": 34},
    "color": {"color": "green", "shade": "dark"},
    "tags": {"tags": ["python", "rust", "go"]},
    "address": {"street": "12 Baker Street", "city": {"name": "London", "zip": "12345"}},
    "rating": {"score": 4.5, "verified": True},
    "order": {"id": 42, "items": [{"sku": "AB12", "qty": 2}, {"sku": "ZZ9", "qty": 1}]},
    "weather": {"city": "Paris", "temperature": 21.5, "unit": "C"},
    "matrix": {"rows": [[1, -2], [3, 4]]},
    "event": {"title": "Team sync", "kind": "meeting", "attendees": [{"name": "Bob", "vip": False}]},
    "answer": {"answer": "yes", "confidence": 0.9, "reasons": ["clear", "simple"]},
}


def run_xgrammar(tok_json: Path, schemas: list[dict], docs: list[list[int]], eos: list[int]) -> dict[str, float]:
    import xgrammar as xgr
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    vocab = Tokenizer.from_file(str(tok_json)).get_vocab(with_added_tokens=True)
    enc = [""] * len(vocab)
    for s, i in vocab.items():
        enc[i] = s
    info = xgr.TokenizerInfo(enc, vocab_type=xgr.VocabType.BYTE_LEVEL, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = [compiler.compile_json_schema(json.dumps(s["schema"]), any_whitespace=False,
                                             separators=(",", ":")) for s in schemas]
    compile_s = (time.perf_counter() - t0) / len(schemas)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    per_token = []
    for g, doc in zip(compiled, docs, strict=True):
        m = xgr.GrammarMatcher(g)
        t0 = time.perf_counter()
        for t in doc:
            m.fill_next_token_bitmask(bitmask, 0)
            assert m.accept_token(t), "xgrammar rejected a valid document"
        m.fill_next_token_bitmask(bitmask, 0)
        per_token.append((time.perf_counter() - t0) / (len(doc) + 1))
    return {"setup_s": setup, "compile_s": compile_s, "per_token_us": statistics.mean(per_token) * 1e6}


def run_llguidance(tok_json: Path, schemas: list[dict], docs: list[list[int]], eos: list[int]) -> dict[str, float]:
    import llguidance

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(str(tok_json), eos_token=eos)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars = [llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s["schema"]),
                                                              defaults={"whitespace_flexible": False})
                for s in schemas]
    matchers = [llguidance.LLMatcher(tok, g) for g in grammars]
    compile_s = (time.perf_counter() - t0) / len(schemas)
    bitmask = np.zeros((1, (tok.vocab_size + 31) // 32), dtype=np.int32)
    per_token = []
    for m, doc in zip(matchers, docs, strict=True):
        assert not m.is_error(), m.get_error()
        t0 = time.perf_counter()
        for t in doc:
            m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            assert m.consume_token(t), f"llguidance rejected a valid document: {m.get_error()}"
        m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        per_token.append((time.perf_counter() - t0) / (len(doc) + 1))
    return {"setup_s": setup, "compile_s": compile_s, "per_token_us": statistics.mean(per_token) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from phasesplit.runtime.model.files import read_config
    from phasesplit.runtime.model.loader import resolve
    from phasesplit.runtime.model.tokenizer import TextTokenizer

    files = resolve("smollm2")
    tok = TextTokenizer(files.folder)
    eos = list(read_config(files).eos_token_ids)
    schemas = json.loads(DATA.read_text())
    docs = [tok.encode(json.dumps(EXAMPLES[s["name"]], separators=(",", ":"))) for s in schemas]
    print(f"vocab {tok.vocab_size}, {len(schemas)} schemas, {sum(map(len, docs))} document tokens")
    for name, fn in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
        runs = [fn(files.folder / "tokenizer.json", schemas, docs, eos) for _ in range(args.repeat)]
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        print(f"{name:11s} setup {best['setup_s'] * 1e3:7.1f} ms  compile/schema {best['compile_s'] * 1e3:7.2f} ms  "
              f"mask+advance {best['per_token_us']:7.1f} us/token")


if __name__ == "__main__":
    main()
