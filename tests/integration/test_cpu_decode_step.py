"""The one-call decode step (runtime/engine/cpu_decode_step.py) on both CPU paths of dtype auto:
native bf16 (AVX512-BF16) and the AVX2 fp32-activation path (forced on a bf16 CPU with
PHASESPLIT_NATIVE_BF16=0, so a newer CPU tests both). The same tokens and logprobs, bit for bit,
as the layer-by-layer forward in the same engine, for bf16 weights and GGUF blocks served
natively, at batch 1 (one thread, matmuls shared with the decode helpers) and at a batch past the
one-thread rule (OpenMP threads); and a step whose kernel rejects its arguments leaves the forward
serving, with nothing lost."""

from __future__ import annotations

import os

import pytest
import torch

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.kernels import build
from phasesplit.runtime.model.files import builtin_gguf
from phasesplit.runtime.request import SamplingParams
from tests.kernels import built_or_skip
from tests.quant_models import q8_0_copy

NO_NATIVE_BF16 = "this CPU has no AVX512-BF16: dtype auto serves fp32 activations, not the native bf16 path"
NO_KERNELS = "the AVX2 fp32 kernels (AVX2, FMA, F16C) cannot be built here: decode runs torch's ops"
PATHS = ("native bf16", "avx2 fp32")
PROMPT_LENS = (9, 23, 40, 61, 17, 33)  # six: past the one-thread batch rule (4); several KV blocks each


def _engine(model: str, quantization: str, path: str) -> LLMEngine:
    if path == "native bf16":
        if os.environ.get("PHASESPLIT_NATIVE_BF16") == "0":
            pytest.skip("PHASESPLIT_NATIVE_BF16=0 is set: this run serves the AVX2 fp32 path only")
        built_or_skip(build.library(), build.BF16, "bf16 kernels", NO_NATIVE_BF16)
    built_or_skip(build.layer_f32_library(), build.BF16W, "fp32 layer kernels", NO_KERNELS)
    with pytest.MonkeyPatch.context() as env:  # read once, when the runner picks its dtype
        if path == "avx2 fp32":
            env.setenv("PHASESPLIT_NATIVE_BF16", "0")
        eng = LLMEngine(model, EngineConfig(runner=RunnerConfig(kv_cache_memory=64 << 20, quantization=quantization),
                                            prefix_caching=False))  # a second run recomputes its prompt
    want = torch.bfloat16 if path == "native bf16" else torch.float32
    assert eng.runner.dtype == want, f"dtype auto should be {want} on the {path} path"
    assert eng.runner.cpu_step is not None, f"the {path} path should decode in one call"
    return eng


@pytest.fixture(scope="module", params=[(m, p) for p in PATHS for m in ("bf16 weights", "q8_0", "q4_1")],
                ids=lambda mp: f"{mp[1]}-{mp[0]}")
def engine(request) -> LLMEngine:
    weights, path = request.param
    if weights == "bf16 weights":
        return _engine("smollm2", "none", path)
    return _engine(str(q8_0_copy() if weights == "q8_0" else builtin_gguf("smollm2")), weights, path)


def _prompts() -> list[list[int]]:
    return [[(7919 * i + 31 * n) % 30000 + 1000 for i in range(n)] for n in PROMPT_LENS]


def _both_ways(eng: LLMEngine, run) -> tuple[object, object]:
    step = eng.runner.cpu_step
    before = step.steps
    one_call = run()
    assert step.steps > before and step.enabled and step.checked, "the one-call step did not run"
    step.enabled = False
    try:
        layered = run()
    finally:
        step.enabled = True
    return one_call, layered


def test_batch_of_one_same_tokens_and_logprobs(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompt = _prompts()[2]

    def run():
        return [(o.new_token_ids, o.logprobs) for o in engine.run_to_end("one", prompt, params)]

    one_call, layered = _both_ways(engine, run)
    assert one_call == layered and sum(len(t) for t, _ in one_call) == 24


def test_batch_past_the_one_thread_rule_same_tokens(engine: LLMEngine) -> None:
    assert len(PROMPT_LENS) > engine.runner.small_decode_batch
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    one_call, layered = _both_ways(engine, lambda: engine.generate(_prompts(), params))
    assert one_call == layered and all(len(t) == 20 for t in one_call)


@pytest.mark.parametrize("path", PATHS)
def test_rejected_arguments_leave_the_forward_serving(caplog, path: str) -> None:
    eng = _engine("smollm2", "none", path)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts()[:3]
    want = eng.generate(prompts, params)
    step = eng.runner.cpu_step
    assert step.enabled and step.checked
    step.layers[5].down.k = 3  # an odd inner size: the bf16-weight kernel refuses it
    got = eng.generate(prompts, params)
    assert not step.enabled, "a rejected argument should turn the one-call step off"
    assert got == want, "the step that failed must be recomputed layer by layer, not lost"
    assert "code -509" in caplog.text  # layer 5, op 9 (down): the code names where it failed
