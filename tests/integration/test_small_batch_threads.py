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


def test_batched_decode_steps_share_matmuls_and_attention_with_the_helpers() -> None:
    """On the native bf16 path's one-call decode step, a step of 20 sequences (more than the
    helpers once took) runs on one thread with its matmuls and attention shared with the decode
    helpers; every sequence's tokens and logprobs are the same bits as with the caller alone."""
    from phasesplit.runtime.kernels import build, cpu_gemm_avx2

    eng = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(kv_cache_memory=64 << 20)))
    runner, lib = eng.runner, build.bf16w_library()
    if runner.dtype != torch.bfloat16 or runner.cpu_step is None or not runner.decode_helpers or lib is None:
        pytest.skip("not the native bf16 path with its one-call decode step and decode helpers (needs "
                    "AVX512-BF16, a C compiler and two CPUs)")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    # 12 tokens each, under one KV block: no prefix-cache hit on the second run
    prompts = {f"s{i}": list(range(4000 + 40 * i, 4012 + 40 * i)) for i in range(20)}

    def run() -> tuple[dict[str, list], set[int]]:
        for rid, p in prompts.items():
            eng.add_request(rid, p, params)
        outs: dict[str, list] = {}
        decode_threads: set[int] = set()
        while eng.seqs:
            decoding = len(outs) == len(prompts)  # every prompt done: a step of 20 decode rows
            for o in eng.step():
                outs.setdefault(o.request_id, []).append((o.new_token_ids, o.logprobs))
            if decoding and eng.seqs:
                decode_threads.add(torch.get_num_threads())
        return outs, decode_threads

    steps, before = runner.cpu_step.steps, cpu_gemm_avx2.helper_stats(lib)[0]
    shared, threads = run()
    assert runner.cpu_step.steps > steps, "the 20-row decode steps did not take the one-call step"
    assert threads == {1}, f"20-row decode steps ran on {threads} threads, not one plus the helpers"
    assert cpu_gemm_avx2.helper_stats(lib)[0] > before, "no matmul or attention of the decode steps ran on a helper"
    assert cpu_gemm_avx2.use_helpers(lib, False)
    try:
        alone, _ = run()
    finally:
        cpu_gemm_avx2.use_helpers(lib, True)
    assert len(shared) == 20 and all(len(v) == 6 for v in shared.values())
    assert shared == alone
