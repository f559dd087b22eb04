"""Under sleeping OpenMP waits (the runtime default, and tests/conftest.py's) a decode step of a
few sequences runs on one thread; prefill and large batches use them all."""

import pytest
import torch

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import SMALL_DECODE_BATCH, RunnerConfig
from phasesplit.runtime.request import SamplingParams
from tests.kernels import decode_with_and_without_helpers


def test_decode_of_few_sequences_runs_single_threaded() -> None:
    eng = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype="float32", kv_cache_memory=64 << 20)))
    runner = eng.runner
    full = runner.threads
    small = 1 if full > 1 else full  # a one-CPU machine has nothing to switch
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.add_request("a", list(range(1000, 1040)), params)
    eng.step()  # the prompt: a prefill step
    assert torch.get_num_threads() == full
    eng.step()  # one decode sequence
    assert torch.get_num_threads() == small
    for i in range(SMALL_DECODE_BATCH + 1):
        eng.add_request(f"b{i}", list(range(2000 + i, 2020 + i)), params)
    eng.step()  # prefills join: all threads again
    assert torch.get_num_threads() == full
    while eng.seqs:
        eng.step()


def test_one_sequence_decode_shares_the_cpu_kernels_matmuls_with_helpers() -> None:
    """dtype auto serves the projections from this CPU's matmul kernel (AVX512-BF16, or bf16
    weights on AVX2); a decode step of one sequence runs on one thread and shares those matmuls
    with the runner's helper threads (kernels/decode_helpers.c): they take part, and the tokens
    and logprobs are the same bits as with that thread alone."""
    from phasesplit.runtime.kernels import build
    from phasesplit.runtime.model.llama import Linear

    eng = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(kv_cache_memory=64 << 20)))
    lib = build.bf16w_library()
    linears = [m for m in eng.runner.model.modules() if isinstance(m, Linear)]
    if lib is None or not all(m._gemm_shared is not None for m in linears):
        pytest.skip("no CPU matmul kernel serves the weights here (no AVX2/FMA/F16C or no C compiler): torch's "
                    "matmuls, no helpers")
    decode_with_and_without_helpers(eng, lib, "matmul block")
