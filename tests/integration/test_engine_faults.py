"""A fault while serving one request fails that request alone; a fault that stays stops the
engine and turns /health's answer to 'failed' (the real engine, in-process)."""

from __future__ import annotations

import asyncio
import math

import pytest

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.request import SamplingParams
from phasesplit.runtime.server.async_engine import MAX_FAILED_STEPS, AsyncEngine, EngineDead, GenerationFailed


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype="float32", kv_cache_memory=32 << 20)))


async def _run(aengine: AsyncEngine, rid: str, params: SamplingParams) -> str | list[int]:
    ids: list[int] = []
    try:
        async for out in aengine.generate(rid, [1, 2, 3, 4], params):
            ids += out.new_token_ids
    except (GenerationFailed, EngineDead) as e:  # failed alone / with the engine
        return str(e)
    return ids


def test_a_poisoned_request_fails_alone(engine):
    # A request that slipped past validation (NaN temperature: multinomial raises on NaN
    # probabilities) batched with healthy ones: it fails, they finish, the engine stays up.
    aengine = AsyncEngine(engine)
    try:
        async def main():
            return await asyncio.gather(
                _run(aengine, "bad", SamplingParams(max_tokens=4, temperature=math.nan, n=2)),
                # logprobs: the healthy rows' logprobs still line up with their tokens
                *(_run(aengine, f"ok{i}", SamplingParams(max_tokens=6, temperature=0.8, seed=i, logprobs=i))
                  for i in range(3)))

        bad, *good = asyncio.run(main())
        assert isinstance(bad, str) and "sampling failed" in bad, bad
        assert all(isinstance(g, list) and len(g) == 6 for g in good), good
        assert aengine.alive() == (True, "ok")
        assert engine.state()["allocated_blocks"] == 0 and not engine.seqs
    finally:
        aengine.shutdown()


def test_an_engine_that_keeps_failing_fails_health(engine):
    aengine = AsyncEngine(engine)
    run = engine.runner.run
    # The device failing on every step (a fault no request brought in): the only way to make the
    # engine fail for good without breaking the machine, so the model runner is swapped out here.
    engine.runner.run = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    try:
        async def main():
            results = []
            for i in range(MAX_FAILED_STEPS):
                results.append(await _run(aengine, f"r{i}", SamplingParams(max_tokens=2)))
            return results

        results = asyncio.run(main())
        assert all(isinstance(r, str) and "device lost" in r for r in results), results
        ok, why = aengine.alive()
        assert not ok and "device lost" in why
    finally:
        engine.runner.run = run
        aengine.shutdown()
