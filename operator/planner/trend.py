"""The request rate's trend: where a steady rise will be one reaction time from now.

A reactive planner sized for the rate it measures is one reaction time (replica start-up plus
an interval) behind a load that keeps rising: on the diurnal morning ramp decode ran at the
edge of its KV for minutes and fell over before the replica it then ordered was up. The trend
is a least-squares line through the last `window_s` of windows' rates; it counts only when its
slope is positive beyond `z` standard errors and rises by `min_rise` of the mean over the window
(a steady load's Poisson scatter makes none), and then the rate one horizon ahead is on that line. Bursts are the burst memory's (bursts.py):
a step, not a line. Pure: time is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class RateTrend:
    window_s: float = 300.0
    z: float = 3.0
    # ...and the line rises by at least this fraction of its mean over the window: a slope of
    # noise that passes the z test (one window in hundreds does) stays a small one.
    min_rise: float = 0.2
    min_points: int = 8
    points: deque[tuple[float, float]] = field(default_factory=deque)  # (time, rate)

    def observe(self, now: float, rate: float) -> None:
        self.points.append((now, rate))
        while self.points and self.points[0][0] <= now - self.window_s:
            self.points.popleft()

    def rise(self, now: float, horizon_s: float) -> tuple[float, float] | None:
        """(slope in req/s per second, the rate on the line `horizon_s` after `now`) when the
        line is a rise beyond noise, else None."""
        n = len(self.points)
        if n < self.min_points:
            return None
        mt = sum(t for t, _ in self.points) / n
        mr = sum(r for _, r in self.points) / n
        sxx = sum((t - mt) ** 2 for t, _ in self.points)
        if sxx <= 0:
            return None
        b = sum((t - mt) * (r - mr) for t, r in self.points) / sxx
        resid = sum((r - mr - b * (t - mt)) ** 2 for t, r in self.points)
        se = math.sqrt(resid / (n - 2) / sxx)
        span = self.points[-1][0] - self.points[0][0]
        if not (b > 0 and b > self.z * se and b * span >= self.min_rise * mr):
            return None
        return b, mr + b * (now + horizon_s - mt)
