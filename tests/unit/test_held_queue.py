"""The router's held queue (runtime/server/held.py) and the routing rule that decides what a
request must wait for (routing.missing_phase)."""

from __future__ import annotations

import asyncio

import pytest

from phasesplit.runtime.request import Overloaded, Unavailable
from phasesplit.runtime.server.held import HeldQueue
from phasesplit.runtime.server.routing import Pool, Worker, missing_phase


def pool(*workers: Worker) -> Pool:
    return Pool({w.url: w for w in workers})


def test_missing_phase_decode_always_prefill_only_when_decode_may_not_prefill():
    up, down = Worker("d", True), Worker("p", False)
    assert missing_phase(pool(), pool(), need_prefill=False) == "decode"
    assert missing_phase(pool(Worker("d", False)), pool(Worker("p", True)), need_prefill=True) == "decode"
    assert missing_phase(pool(up), pool(down), need_prefill=False) is None  # decode prefills locally
    assert missing_phase(pool(up), pool(down), need_prefill=True) == "prefill"
    assert missing_phase(pool(up), pool(Worker("p", True)), need_prefill=True) is None
    # A decode worker that just refused the request (draining) does not count.
    assert missing_phase(pool(up), pool(), need_prefill=False, exclude={"d"}) == "decode"


def test_wait_returns_at_once_when_nothing_is_missing():
    q = HeldQueue(1, 10.0)
    assert asyncio.run(q.wait(lambda: None)) == 0.0
    assert q.held == 0


def test_held_until_the_pools_change_then_released():
    waits: list[float] = []

    async def main() -> float:
        q = HeldQueue(4, 30.0, on_wait=waits.append)
        missing = ["decode"]
        task = asyncio.create_task(q.wait(lambda: missing[0]))
        await asyncio.sleep(0.05)
        assert q.held == 1 and not task.done()
        q.changed()  # a poll round with still no worker: it keeps waiting
        await asyncio.sleep(0.05)
        assert not task.done()
        missing[0] = None
        q.changed()
        held_for = await asyncio.wait_for(task, 5)
        assert q.held == 0
        return held_for

    held_for = asyncio.run(main())
    assert held_for >= 0.1 and waits == [pytest.approx(held_for, abs=0.05)]


def test_full_queue_is_429_and_timeout_is_503():
    async def main() -> None:
        q = HeldQueue(1, 0.3)
        first = asyncio.create_task(q.wait(lambda: "decode"))
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match="already held"):
            await q.wait(lambda: "decode")
        with pytest.raises(Unavailable, match="no decode worker became available within 0.3s") as e:
            await first
        assert e.value.retry_after >= 1 and q.held == 0

    asyncio.run(main())


def test_no_holding_with_a_zero_timeout():
    with pytest.raises(Unavailable, match="no prefill worker is available"):
        asyncio.run(HeldQueue(8, 0.0).wait(lambda: "prefill"))


def test_a_cancelled_wait_leaves_the_queue():
    async def main() -> None:
        q = HeldQueue(1, 30.0)
        task = asyncio.create_task(q.wait(lambda: "decode"))
        await asyncio.sleep(0.05)
        assert q.held == 1
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert q.held == 0
        other = asyncio.create_task(q.wait(lambda: "decode"))  # its place is free again
        await asyncio.sleep(0.05)
        assert q.held == 1
        other.cancel()

    asyncio.run(main())
