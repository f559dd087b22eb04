"""A work queue of InferenceService keys with client-go's workqueue semantics.

- A key waits in the queue at most once, however many events asked for it.
- A key is never processed by two workers at once: one added while it is processed is queued
  again when that pass ends (so the later event is never lost).
- A failed key comes back after a per-key exponential backoff; a success resets it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable


class WorkQueue:
    def __init__(self, base_delay: float = 0.5, max_delay: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.base_delay, self.max_delay, self.clock = base_delay, max_delay, clock
        self._cond = threading.Condition()
        self._ready: deque[Hashable] = deque()
        self._queued: set[Hashable] = set()
        self._active: set[Hashable] = set()
        self._again: set[Hashable] = set()
        self._later: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()
        self._failures: dict[Hashable, int] = {}
        self._closed = False

    def add(self, key: Hashable) -> None:
        with self._cond:
            self._offer(key)

    def _offer(self, key: Hashable) -> None:
        """Queue a key (lock held): once, and after its current pass if one runs."""
        if key in self._active:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._ready.append(key)
            self._cond.notify()

    def add_after(self, key: Hashable, delay: float) -> None:
        with self._cond:
            heapq.heappush(self._later, (self.clock() + delay, next(self._seq), key))
            self._cond.notify()

    def retry(self, key: Hashable) -> float:
        """Queue a failed key again after its backoff; returns the delay."""
        with self._cond:
            n = self._failures.get(key, 0)
            self._failures[key] = n + 1
        delay = min(self.base_delay * 2**n, self.max_delay)
        self.add_after(key, delay)
        return delay

    def forget(self, key: Hashable) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def get(self, timeout: float | None = None) -> Hashable | None:
        """The next key to process (None: closed, or nothing within timeout); call done() after."""
        deadline = None if timeout is None else self.clock() + timeout
        with self._cond:
            while True:
                self._promote()
                if self._closed:
                    return None
                if self._ready:
                    key = self._ready.popleft()
                    self._queued.discard(key)
                    self._active.add(key)
                    return key
                wait = self._later[0][0] - self.clock() if self._later else None
                if deadline is not None:
                    left = deadline - self.clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def done(self, key: Hashable) -> None:
        with self._cond:
            self._active.discard(key)
            if key in self._again:
                self._again.discard(key)
                self._offer(key)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready) + len(self._later)

    def _promote(self) -> None:
        now = self.clock()
        while self._later and self._later[0][0] <= now:
            _, _, key = heapq.heappop(self._later)
            self._offer(key)
