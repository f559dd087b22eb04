"""dtype auto on an AVX2 CPU without AVX512-BF16: fp32 activations with the projections' weights
kept in bf16 (cpu_gemm_avx2) and the rest of each layer in fp32 kernels (cpu_layer_f32) give
float32's greedy tokens on the 8 prompts of the quantized test, or a first divergence explained by a logit tie (tests/greedy.py's rule, margins printed)."""

from __future__ import annotations

import pytest
import torch

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.kernels import build
from phasesplit.runtime.model.llama import Linear
from tests.greedy import compare, greedy_with_top2
from tests.kernels import decode_with_and_without_helpers
from tests.prompts import all_prompt_ids

NEW_TOKENS = 32
PROMPTS = 8
# Rounding the weights to bf16 (8 significant bits) moves logits; a move of a top-2 margin larger
# than this, at positions where both paths agree, means a broken kernel (measured 0.10 here).
MAX_MARGIN_MOVE = 0.5


def _engine(dtype: str) -> LLMEngine:
    return LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype=dtype, kv_cache_memory=64 << 20)))


@pytest.fixture(scope="module")
def auto_engine() -> LLMEngine:
    eng = _engine("auto")
    if eng.runner.dtype != torch.float32:
        pytest.skip(f"dtype auto is {eng.runner.dtype} on this CPU (native bf16): the bf16-weight AVX2 path is not used")
    if build.bf16w_library() is None:
        pytest.skip("the bf16-weight AVX2 kernel cannot run here (no AVX2/FMA or no C compiler): weights stay fp32")
    return eng


def test_auto_keeps_every_projection_in_bf16(auto_engine: LLMEngine) -> None:
    model = auto_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)] + [model.tied_head]
    assert all(m is not None and m._bf16w and m.tiled.dtype == torch.bfloat16 and m.weight.numel() == 0
               for m in linears)
    assert model.embed.weight.dtype == torch.float32 and auto_engine.runner.kv_cache.dtype == torch.float32
    # and the rest of each layer in the fp32 AVX2 kernels (same CPU flags and compiler)
    assert model.layer_f32 is not None and auto_engine.runner.paged_kernel


def test_auto_greedy_matches_float32(auto_engine: LLMEngine) -> None:
    from phasesplit.runtime.model.loader import resolve
    from phasesplit.runtime.model.tokenizer import TextTokenizer

    prompts = all_prompt_ids(TextTokenizer(resolve("smollm2").folder))[:PROMPTS]
    reference = _engine("float32")
    assert reference.runner.model.layer_f32 is None and not reference.runner.paged_kernel, "float32 is torch's ops"
    ref = greedy_with_top2(reference, prompts, NEW_TOKENS)
    compare("bf16 weights", ref, greedy_with_top2(auto_engine, prompts, NEW_TOKENS), NEW_TOKENS, MAX_MARGIN_MOVE)


def test_decode_steps_of_one_sequence_share_their_matmuls_with_helpers(auto_engine: LLMEngine) -> None:
    """With sleeping OpenMP waits a decode step of one sequence runs on one thread, its matmuls
    shared with the runner's helper threads (kernels/decode_helpers.c): they take part, and the
    tokens and logits are the same bits as with the step's matmuls on that thread alone."""
    decode_with_and_without_helpers(auto_engine, build.bf16w_library(), "matmul chunk")
