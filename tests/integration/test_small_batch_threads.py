"""Under sleeping OpenMP waits (the runtime default, and tests/conftest.py's) a decode step of a
few sequences runs on one thread; prefill and large batches use them all."""

import torch

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import SMALL_DECODE_BATCH, RunnerConfig
from phasesplit.runtime.request import SamplingParams


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
