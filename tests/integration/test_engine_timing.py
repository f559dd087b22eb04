"""phasesplit_timing's queue: a request counts as queued from when it is handed to the engine
thread, not from when that thread, busy with a step, takes it in (the real engine, in-process)."""

from __future__ import annotations

import asyncio
import time

import pytest

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.request import SamplingParams
from phasesplit.runtime.server.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype="float32", kv_cache_memory=32 << 20)))


def test_the_wait_for_the_engine_thread_counts_as_queued(engine):
    aengine = AsyncEngine(engine)
    try:
        async def main() -> dict[str, float]:
            # The engine thread busy for 0.3 s (a long step, in effect) when the request comes in.
            aengine.call(lambda e: time.sleep(0.3))
            timing = None
            async for out in aengine.generate("r", [1, 2, 3, 4], SamplingParams(max_tokens=2)):
                timing = out.timing or timing
            assert timing is not None
            return timing

        timing = asyncio.run(main())
        assert timing["queued_s"] >= 0.25, timing
        assert timing["prefill_s"] < timing["queued_s"], timing  # a 4-token prompt takes far less
    finally:
        aengine.shutdown()


def test_an_arrival_in_the_future_is_not_taken(engine):
    # A caller's clock cannot make a request look queued for less than no time.
    seq = engine.add_request("f", [1, 2, 3], SamplingParams(max_tokens=1), arrival=time.monotonic() + 60)
    assert seq.arrival <= time.monotonic()
    engine.abort("f")
