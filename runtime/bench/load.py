"""When requests are sent: open-loop arrivals (Poisson, gamma for bursts, or a trace's own times),
optionally capped by a concurrency limit, or closed-loop at a fixed concurrency.

Open loop matters for serving benchmarks: a closed loop slows its own arrivals when the server
slows down and so hides queueing, which is exactly what TTFT under load should show.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence

from .metrics import RequestResult
from .workload import RequestSpec


def parse_rates(text: str) -> list[float]:
    """'1,2,4' or 'inf' -> request rates per second; inf sends everything at once."""
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            rate = math.inf if part in ("inf", "infinity") else float(part)
        except ValueError:
            raise ValueError(f"not a request rate: {part!r} (use e.g. 1,2,4 or inf)") from None
        if not rate > 0:
            raise ValueError(f"request rate must be positive, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times, seconds from the start, for n requests at `rate` per second.

    Gaps are gamma-distributed with shape `burstiness` and mean 1/rate: burstiness 1 is a
    Poisson process, below 1 burstier, above 1 more regular. The first request goes at 0.
    """
    if n < 0:
        raise ValueError("n must be non-negative")
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out


def trace_offsets(specs: Sequence[RequestSpec]) -> list[float]:
    if any(s.arrival_s is None for s in specs):
        raise ValueError("trace replay needs an arrival time on every request")
    return [float(s.arrival_s) for s in specs]  # type: ignore[arg-type]


class Interrupted(Exception):
    """The run was cancelled; carries the requests that completed before it and the duration."""

    def __init__(self, results: list[RequestResult], duration_s: float):
        super().__init__("interrupted")
        self.results, self.duration_s = results, duration_s


Send = Callable[[RequestSpec, str], Awaitable[RequestResult]]


class ErrorBreaker:
    """Stops sending when the server fails every request: `limit` failures in a row with no
    success since the start. A few errors inside a working run are recorded, not fatal."""

    def __init__(self, limit: int):
        self.limit = limit
        self.failed_in_row = 0
        self.any_ok = False

    def record(self, r: RequestResult) -> None:
        if r.ok:
            self.any_ok, self.failed_in_row = True, 0
        else:
            self.failed_in_row += 1

    @property
    def tripped(self) -> bool:
        return self.limit > 0 and not self.any_ok and self.failed_in_row >= self.limit


async def run_schedule(
    specs: Sequence[RequestSpec],
    prompts: Sequence[str],
    offsets: Sequence[float],
    send: Send,
    max_concurrency: int | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
    breaker: ErrorBreaker | None = None,
) -> tuple[list[RequestResult], float]:
    """Send specs[i] with prompts[i] at offsets[i] (waiting for a slot when max_concurrency is
    reached). Returns the results of the requests actually sent, in index order, and the
    duration from the first send to the last completion."""
    if not len(specs) == len(prompts) == len(offsets):
        raise ValueError("specs, prompts and offsets must have the same length")
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    first_send: list[float] = []

    async def one(spec: RequestSpec, prompt: str) -> None:
        if sem is not None:
            await sem.acquire()
        try:
            if breaker is not None and breaker.tripped:
                return
            if not first_send:
                first_send.append(time.perf_counter())
            r = await send(spec, prompt)
        finally:
            if sem is not None:
                sem.release()
        results.append(r)
        if breaker is not None:
            breaker.record(r)
        if on_done is not None:
            on_done(r)

    t0 = time.perf_counter()
    tasks = []
    try:
        for spec, prompt, off in zip(specs, prompts, offsets, strict=True):
            if breaker is not None and breaker.tripped:
                break
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, prompt)))
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        # Ctrl-C or SIGTERM: stop in-flight requests and hand back what finished.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        end = time.perf_counter()
        results.sort(key=lambda r: r.index)
        raise Interrupted(results, end - (first_send[0] if first_send else end)) from None
    end = time.perf_counter()
    duration = end - (first_send[0] if first_send else end)
    results.sort(key=lambda r: r.index)
    return results, duration
