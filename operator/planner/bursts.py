"""Burst memory: capacity for flash crowds only while they keep recurring.

A reactive planner is one reaction time (interval + replica start-up) behind the load. When the
request rate has been seen to multiply within that time, the next such burst will rise faster
than new replicas can start, so some capacity for it must already be there. Holding it forever
(or for a fixed memory) costs every lull after the last burst; holding none fails every burst.

This module learns the bursts themselves: a burst starts when the smoothed rate rises beyond
Poisson noise (3σ) within one reaction time, its peak is the highest rate until the rate falls
back to where it started (a rise of less than `min_jump` is a drift), and the gaps between burst starts are remembered. Headroom for the
remembered peak is kept until `decay` times the longest learned gap has passed since the last
burst ended (or `first_hold_s` while only one burst has been seen): bursts that keep coming keep
their capacity; once they stop, the memory lets go within that time. Pure: time is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Burst:
    start: float
    base: float  # smoothed rate before the rise
    peak: float
    end: float | None = None  # when the rate fell back to the base (None: still on)
    rise_s: float | None = None  # from its start to 90 % of its peak (known once it ended)
    # The rate it held at its top (known once it ended): the median of its smoothed rates within
    # the top fifth of its rise. `peak`, the highest single reading, sits above that level by the
    # noise of a few dozen Poisson counts, and the highest of several bursts' peaks more so:
    # capacity held for the next burst is sized from the level the bursts reached.
    level: float | None = None
    trace: list[tuple[float, float]] = field(default_factory=list)  # (time, smoothed rate) while on


def plateau(base: float, peak: float, rates: list[float]) -> float:
    """The median of the rates within the top fifth of a rise from `base` to `peak`: the level
    held, which neither the ramp's last readings nor the highest scatter move much."""
    top = sorted(r for r in rates if r >= base + 0.8 * (peak - base))
    if not top:
        return peak
    mid = len(top) // 2
    return top[mid] if len(top) % 2 else (top[mid - 1] + top[mid]) / 2


@dataclass(frozen=True)
class Headroom:
    rate: float  # rate to keep capacity for (≥ the current rate)
    factor: float  # the remembered bursts' largest peak ÷ base
    rising: bool  # a burst is under way now (the newest rate is its peak so far)
    until: float | None  # when the memory lets go if no burst comes (None: nothing held)
    note: str = ""
    # A remembered burst rose to its peak faster than one reaction time: the next one will be at
    # its peak before replicas ordered at its start are up, so the capacity held must meet the
    # peak's latency target, not only carry its throughput.
    sudden: bool = False
    # Every burst that ended took longer than a reaction time to rise (and one did end): the
    # next can be met by scaling up as it rises.
    gradual: bool = False


@dataclass
class BurstMemory:
    interval_s: float
    reaction_s: float  # interval + replica start-up: how far behind a reactive planner is
    memory_s: float = 3600.0  # bursts older than this are forgotten whatever the gaps say
    decay: float = 1.5  # hold headroom this many longest gaps after the last burst ended
    first_hold_s: float = 900.0  # hold after a single burst (no gap learned yet)
    max_factor: float = 3.0
    # A rise smaller than this (beyond noise) within a reaction time is absorbed by the slack the
    # sizing keeps anyway (its latency margin and scale-down tolerance): a drift, not a burst.
    min_jump: float = 0.2
    rates: deque[tuple[float, float]] = field(default_factory=deque)  # (time, smoothed rate)
    bursts: list[Burst] = field(default_factory=list)
    _last_raw: float | None = None

    def noise(self, rate: float) -> float:
        """3σ of a Poisson rate measured over two windows."""
        return 3 * math.sqrt(max(rate, 0.0) / (2 * self.interval_s))

    def observe(self, now: float, rate: float) -> None:
        smooth = rate if self._last_raw is None else (rate + self._last_raw) / 2
        self._last_raw = rate
        self.rates.append((now, smooth))
        while self.rates and self.rates[0][0] < now - self.reaction_s:
            self.rates.popleft()
        while self.bursts and (self.bursts[0].end or now) < now - self.memory_s:
            self.bursts.pop(0)
        cur = self.bursts[-1] if self.in_burst() else None
        if cur is not None:
            cur.peak = max(cur.peak, smooth)
            cur.trace.append((now, smooth))
            # Over when the rate is back within noise of where the burst started.
            if smooth <= cur.base + self.noise(cur.base):
                cur.end = now
                top = cur.base + 0.9 * (cur.peak - cur.base)
                cur.rise_s = next(t for t, r in cur.trace if r >= top) - cur.start
                cur.level = plateau(cur.base, cur.peak, [r for _, r in cur.trace])
                cur.trace = []
            return
        # A new burst: a rise beyond noise within one reaction time from its low.
        low_t, low = min(self.rates, key=lambda x: (x[1], -x[0]))
        if low_t < now and low > 0 and smooth - self.noise(low) > low * (1 + self.min_jump):
            self.bursts.append(Burst(start=low_t, base=low, peak=smooth, trace=[(now, smooth)]))

    def in_burst(self) -> bool:
        """Whether a burst is open (risen and not yet ended)."""
        return bool(self.bursts) and self.bursts[-1].end is None

    def level(self) -> float | None:
        """The highest level the ended bursts in memory held (None: none has ended)."""
        return max((b.level for b in self.bursts if b.level is not None), default=None)

    def hold_s(self) -> float:
        """How long after the last burst ended its headroom is kept."""
        starts = [b.start for b in self.bursts]
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        return self.decay * max(gaps) if gaps else self.first_hold_s

    def headroom(self, now: float, rate: float) -> Headroom:
        """The rate to keep capacity for now (the current rate when no burst memory applies)."""
        if not self.bursts:
            return Headroom(rate, 1.0, False, None)
        last = self.bursts[-1]
        # Under way with its peak unknown: rising, and already beyond every earlier burst's peak
        # (a recurring burst is expected to rise to where its predecessors went, no further).
        known = max((b.peak for b in self.bursts[:-1]), default=0.0)
        # A burst open for longer than two reaction times has become a level: new highs in it are
        # drift, not a rise to extrapolate.
        rising = (last.end is None and self.rates[-1][1] >= last.peak and last.peak > known
                  and now - last.start <= 2 * self.reaction_s)
        until = None if last.end is None else last.end + self.hold_s()
        if until is not None and now > until:
            return Headroom(rate, 1.0, False, None, "burst memory released")
        # The jump beyond noise, as the surge it proved possible (a steady load's noise earns ~none).
        factor = min(max((b.peak - self.noise(b.base)) / b.base for b in self.bursts), self.max_factor)
        # Ended bursts by the level they held (see Burst.level); one still on by its peak so far.
        peak = max(b.peak if b.level is None else b.level for b in self.bursts)
        target = max(rate, min(rate * factor, peak))
        n = len(self.bursts)
        note = (f"{n} burst{'s' * (n != 1)} remembered, peak {peak:.1f} req/s"
                + (f", held until {until - now:.0f}s from now" if until is not None else ", one under way"))
        rises = [b.rise_s for b in self.bursts if b.rise_s is not None]
        sudden = any(r < self.reaction_s for r in rises)
        return Headroom(target, factor, rising, until, note, sudden, bool(rises) and not sudden)
