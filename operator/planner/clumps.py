"""Clump memory: prefill capacity for clumps of long prompts that arrive at an ordinary rate.

Some traffic (the Azure code trace) sends a dozen prompts of 5-7k tokens within a few seconds,
at a request rate no different from the minutes around it. The rate-driven sizing cannot see
such a clump coming, and it is gone (its queue drained) by the time the window that holds its
late first tokens is read. Each clump costs a handful of requests: too few to lift a window's
TTFT percentile past the target, so no miss rule fires, yet clump after clump they spend the
SLO's budget (the percentile is over all requests, not per window).

So a window in which more than `allowed` of the requests (half the SLO's budget) missed with
nothing else to explain it asks for one replica more than served it, once such windows recur
(two within `recur_s`: one is noise). The planner decides what explains a miss: a queue left at
the window's end or just drained, KV short now or within a reaction time, ITL misses, a rate
burst or rise under way, a load at which the queueing model gives more than
`PlannerConfig.clump_queue` of the TTFT budget above service time to waiting (misses there are
queueing, the model's to size), or a TTFT tail beyond what the window's whole prompt work
arriving at once could cause (waits of another kind). That replica is kept while such windows keep coming; once
`step_s` passes without one, one replica less is held, and so on down (a slow probe: the memory
cannot see that fewer replicas would do until a clump arrives with fewer). Pure: time is passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class ClumpMemory:
    allowed: float = 0.025  # share of a window's requests that may miss unexplained
    step_s: float = 300.0  # with no such window for this long, one replica less is held
    recur_s: float = 600.0  # ...and only once such windows recur within this long (one is noise)
    seen: deque[float] = field(default_factory=deque)  # times of the windows over `allowed`
    held: int | None = None
    last: float = 0.0  # the newest window over `allowed`, or the newest step down

    def observe(self, now: float, requests: float, misses: float, serving: int) -> None:
        """One window: its requests, those that missed with nothing else to explain it, and the
        prefill replicas that served it."""
        while self.seen and self.seen[0] <= now - self.recur_s:
            self.seen.popleft()
        if requests > 0 and misses / requests > self.allowed:
            self.seen.append(now)
            if len(self.seen) >= 2 or self.held is not None:
                self.held = max(self.held or 0, serving + 1)
                self.last = now
        elif self.held is not None and now - self.last >= self.step_s:
            self.held = self.held - 1 if self.held > 1 else None
            self.last = now

    def floor(self) -> int | None:
        """Prefill replicas to keep while clumps keep spending the budget, or None."""
        return self.held
