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


BORROW_SCRIPT = r"""
import json, os, sys, torch
from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.kernels import build, cpu_gemm_avx2
from phasesplit.runtime.request import SamplingParams

mine, other = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {mine})  # as `phasesplit up --pin-cpus` starts a worker of one core
eng = LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(threads=1, borrow_cpus=(other,), kv_cache_memory=64 << 20),
                                        prefix_caching=False))
lib = build.bf16w_library()
if lib is None or not eng.runner.decode_helpers:
    print(json.dumps({"skip": "no helpers (no CPU matmul kernel serves the weights here)"}))
    sys.exit(0)
helpers = [t for t in map(int, os.listdir("/proc/self/task")) if t != os.getpid()
           and os.sched_getscheduler(t) == os.SCHED_IDLE]
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
prompt = list(range(1000, 1300))  # 300 tokens: a prefill chunk of 300 rows, past the decode steps' 64

def run(tag):
    return [(o.new_token_ids, o.logprobs) for o in eng.run_to_end(tag, prompt, params)]

before = cpu_gemm_avx2.helper_stats(lib)[0]
eng.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0))
eng.step()  # the prefill alone
prefill_helped = cpu_gemm_avx2.helper_stats(lib)[0] - before
while eng.seqs:
    eng.step()
shared = run("shared")
cpu_gemm_avx2.use_helpers(lib, False)
alone = run("alone")
print(json.dumps({"helpers": [sorted(os.sched_getaffinity(t)) for t in helpers], "prefill_helped": prefill_helped,
                  "same": shared == alone, "tokens": len(shared)}))
"""


def test_a_one_cpu_worker_borrows_another_workers_idle_cpu_for_prefill_too() -> None:
    """A worker pinned to one CPU with --borrow-idle-cpus (what `phasesplit up --pin-cpus` gives
    each worker of a split) runs one helper on the other CPU at idle priority, pinned there; the
    prefill's matmuls (300 rows, more than decode steps share) run partly on it, and the tokens
    and logprobs are the same bits as the caller's alone. In a subprocess: the helper pool is
    per process, and this one leaves it idle-priority."""
    import json
    import os
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: there is no other worker's CPU to borrow")
    out = subprocess.run([sys.executable, "-c", BORROW_SCRIPT, str(cpus[0]), str(cpus[1])], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in got:
        from phasesplit.runtime.kernels import build
        from tests.kernels import can_build

        assert not can_build(build.BF16W), f"the bf16-weight library builds here, yet: {got['skip']}"
        pytest.skip(got["skip"])
    assert got["helpers"] == [[cpus[1]]], f"want one idle-priority helper pinned to CPU {cpus[1]}: {got}"
    assert got["prefill_helped"] > 0, "no matmul chunk of the 300-token prefill ran on the borrowed CPU"
    assert got["same"] and got["tokens"] == 8
