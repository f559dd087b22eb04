"""Histogram arithmetic on cumulative Prometheus buckets: deltas, quantiles, means.

A window's latency distribution is the difference of two scrapes of the cumulative buckets;
the quantile interpolates linearly inside the bucket that holds it, as PromQL's
histogram_quantile does, so both metrics sources agree on what "p95" means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound (le) → cumulative count
    total: float = 0.0  # _sum
    count: float = 0.0  # _count

    def add(self, other: Histogram) -> Histogram:
        """Sum of two histograms with the same buckets (several pods of one phase)."""
        out = Histogram(dict(self.buckets), self.total + other.total, self.count + other.count)
        for le, c in other.buckets.items():
            out.buckets[le] = out.buckets.get(le, 0.0) + c
        return out

    def minus(self, earlier: Histogram) -> Histogram:
        """The window between two scrapes. A counter that went down means the pod restarted:
        its whole current value is then the window's (what PromQL's rate() assumes too)."""
        if self.count < earlier.count:
            return Histogram(dict(self.buckets), self.total, self.count)
        return Histogram({le: c - earlier.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                         self.total - earlier.total, self.count - earlier.count)

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        if self.count <= 0 or not self.buckets:
            return None
        bounds = sorted(self.buckets)
        total = self.buckets[bounds[-1]] if math.isinf(bounds[-1]) else self.count
        rank = q * total
        prev_le, prev_c = 0.0, 0.0
        for le in bounds:
            c = self.buckets[le]
            if c >= rank:
                if math.isinf(le):
                    # In the overflow bucket: the best statement is the highest finite bound.
                    return prev_le
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le

    def fraction_within(self, limit: float) -> float | None:
        """Share of observations ≤ limit, interpolating inside its bucket (the SLO attainment of
        one latency, as far as the buckets can tell)."""
        if self.count <= 0 or not self.buckets:
            return None
        prev_le, prev_c = 0.0, 0.0
        for le in sorted(self.buckets):
            c = self.buckets[le]
            if limit <= le:
                if math.isinf(le):
                    return prev_c / self.count
                return (prev_c + (c - prev_c) * (limit - prev_le) / (le - prev_le)) / self.count
            prev_le, prev_c = le, c
        return prev_c / self.count
