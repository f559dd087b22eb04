"""The router's held queue: requests that find no worker of a phase they need wait here.

A phase scaled to zero (or a service whose workers are not ready yet) has no worker to take a
request. Rather than fail it, the router holds it, bounded in number and in time, until discovery
and polling find a worker up; the held count is exported (metric_names.HELD) and is what wakes
the phases in the operator's planner. Past the bound a request gets 429 (Overloaded), past the
timeout 503 with Retry-After (Unavailable); a request whose client leaves while held is
cancelled, which takes it out of the queue.

No routing decision is made here: `ready()` (routing.missing_phase over the pools) says whether
a request can go on, and the router calls `changed()` after each poll of its workers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from phasesplit.runtime.request import Overloaded, Unavailable

RETRY_AFTER_S = 5  # seconds, in the 503 of a request that waited out the timeout


class HeldQueue:
    """max_held: requests held at once (more get 429); timeout_s: how long one waits (0: never
    hold, answer 503 at once). on_wait: called with each held request's wait, however it ends."""

    def __init__(self, max_held: int, timeout_s: float, on_wait: Callable[[float], None] | None = None) -> None:
        self.max_held, self.timeout_s, self.on_wait = max_held, timeout_s, on_wait
        self.held = 0
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """The pools may have changed (a poll round ended): held requests look again."""
        if self.held:
            self._changed.set()
            self._changed = asyncio.Event()

    async def wait(self, missing: Callable[[], str | None]) -> float:
        """Return at once when `missing()` is None, else hold until it is; the seconds held.

        Raises Overloaded when the queue is full and Unavailable when the timeout passes first.
        """
        what = missing()
        if what is None:
            return 0.0
        if self.timeout_s <= 0:
            raise Unavailable(f"no {what} worker is available; retry later", RETRY_AFTER_S)
        if self.held >= self.max_held:
            raise Overloaded(f"no {what} worker is available and {self.held} requests are already held "
                             "waiting for one; retry later", RETRY_AFTER_S)
        start = time.monotonic()
        deadline = start + self.timeout_s
        self.held += 1
        try:
            while (what := missing()) is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unavailable(f"no {what} worker became available within {self.timeout_s:g}s "
                                      "(held at the router); retry later", RETRY_AFTER_S)
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
            return time.monotonic() - start
        finally:
            self.held -= 1
            if self.on_wait is not None:
                self.on_wait(time.monotonic() - start)
