"""HPA-style scaling behavior: stabilization windows, rate-limit policies, bounds, P:D ratio.

The semantics follow autoscaling/v2 so that a spec written for an HPA means the same here:
- scale-down stabilization: the count never drops below the highest recommendation of the
  window (default 300 s), which is what stops flapping on a noisy steady load;
- scale-up stabilization: the count never rises above the lowest recommendation of its window
  (default 0 s, i.e. react at once);
- policies cap the change per period, measured from the count at the start of the period
  (Pods: ±value; Percent: ×(1 ± value/100)); selectPolicy Max picks the policy allowing the
  biggest change, Min the smallest, Disabled forbids changes in that direction.
One addition: after a restart (empty history) nothing scales down until a whole window of
recommendations has been seen, so losing the operator's memory cannot cause a drop.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from phasesplit.operator.api import Behavior, ScaleDownRules, ScalingPolicy, ScalingRules

# The autoscaling/v2 defaults (the planner's when no spec says otherwise, e.g. in the simulator).
# The rules are the InferenceService API's own types: a spec's behavior is used as written.
DEFAULT_SCALE_UP = ScalingRules(stabilization_window_seconds=0, policies=[
    ScalingPolicy(type="Percent", value=100, period_seconds=15), ScalingPolicy(type="Pods", value=4, period_seconds=15)])
DEFAULT_SCALE_DOWN = ScaleDownRules(stabilization_window_seconds=300, policies=[
    ScalingPolicy(type="Percent", value=100, period_seconds=15)])
HPA_BEHAVIOR = Behavior(scale_up=DEFAULT_SCALE_UP, scale_down=DEFAULT_SCALE_DOWN)


@dataclass
class PhaseLimiter:
    """The memory one phase needs between decisions: recent recommendations and changes."""

    behavior: Behavior
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    changes: deque[tuple[float, int]] = field(default_factory=deque)  # (time, replicas added/removed)
    started: float | None = None

    def apply(self, now: float, current: int, recommended: int, lo: int, hi: int,
              urgent: bool = False, confirm_s: float = 0.0) -> tuple[int, str]:
        """Desired replicas from a raw recommendation; the note says what held it back, if anything.

        `urgent` (an observed SLO miss) skips the scale-up stabilization window; the policies'
        rate limits still hold, since they are the user's declared limit on churn. `confirm_s`
        widens the scale-up window for predictions that no miss backs up: one noisy window then
        cannot buy a replica that the scale-down window would keep for five minutes.
        """
        lo = max(1, lo)  # never to zero: a phase with no replicas cannot report metrics again
        if self.started is None:
            self.started = now
        self.recommendations.append((now, recommended))
        self._prune(now)
        up, down = self.behavior.scale_up, self.behavior.scale_down
        up_window = max(up.stabilization_window_seconds, confirm_s)
        up_rec = recommended if urgent else min(r for t, r in self.recommendations if t >= now - up_window)
        down_rec = max(r for t, r in self.recommendations if t >= now - down.stabilization_window_seconds)
        notes = []
        if now - self.started < down.stabilization_window_seconds:
            # History shorter than the window (fresh start): do not trust it to scale down.
            down_rec = max(down_rec, current)
        stabilized = current
        if stabilized < up_rec:
            stabilized = up_rec
        if stabilized > down_rec:
            stabilized = down_rec
        if stabilized < recommended and recommended > current:
            notes.append(f"scale-up stabilization holds at {stabilized}")
        if stabilized > recommended and recommended < current:
            notes.append(f"scale-down stabilization ({down.stabilization_window_seconds:.0f}s) holds at {stabilized}")
        desired = stabilized
        if desired > current:
            limit = self._limit(now, current, up, +1)
            if desired > limit:
                notes.append(f"scale-up policy limits to {limit}")
                desired = limit
        elif desired < current:
            limit = self._limit(now, current, down, -1)
            if desired < limit:
                notes.append(f"scale-down policy limits to {limit}")
                desired = limit
        if desired > hi:
            notes.append(f"capped at max {hi}")
        if desired < lo:
            notes.append(f"raised to min {lo}")
        desired = min(max(desired, lo), hi)
        self.record(now, current, desired)
        return desired, "; ".join(notes)

    def record(self, now: float, current: int, desired: int) -> None:
        if desired != current:
            self.changes.append((now, desired - current))

    def _limit(self, now: float, current: int, rules: ScalingRules, sign: int) -> int:
        if rules.select_policy == "Disabled":
            return current
        if not rules.policies:
            return 10**9 if sign > 0 else 0  # no policy: no rate limit
        limits = []
        for p in rules.policies:
            # Replicas at the start of this policy's period: undo the changes made within it.
            moved = sum(d for t, d in self.changes if t > now - p.period_seconds and d * sign > 0)
            start = current - moved
            if p.type == "Pods":
                limits.append(start + sign * p.value)
            elif sign > 0:
                limits.append(math.ceil(start * (1 + p.value / 100)))
            else:
                limits.append(math.floor(start * (1 - p.value / 100)))
        # "Max" allows the biggest change in the direction of travel.
        if (rules.select_policy == "Max") == (sign > 0):
            return max(limits)
        return min(limits)

    def _prune(self, now: float) -> None:
        keep = max(self.behavior.scale_up.stabilization_window_seconds,
                   self.behavior.scale_down.stabilization_window_seconds, 3600.0)
        while self.recommendations and self.recommendations[0][0] < now - keep:
            self.recommendations.popleft()
        period = max((p.period_seconds for r in (self.behavior.scale_up, self.behavior.scale_down)
                      for p in r.policies), default=0.0)
        while self.changes and self.changes[0][0] <= now - period:
            self.changes.popleft()


def apply_ratio(prefill: int, decode: int, min_ratio: float | None, max_ratio: float | None,
                prefill_max: int, decode_max: int) -> tuple[int, int, str]:
    """Keep prefill/decode within [min_ratio, max_ratio] by raising the short side, within its max.

    Only raising: lowering a phase to satisfy a ratio would trade an SLO for a proportion.
    """
    note = ""
    if min_ratio is not None and prefill < min_ratio * decode:
        want = min(math.ceil(min_ratio * decode - 1e-9), prefill_max)
        if want > prefill:
            note = f"prefill raised to {want} for P:D ≥ {min_ratio:g}"
            prefill = want
    if max_ratio is not None and prefill > max_ratio * decode:
        want = min(math.ceil(prefill / max_ratio - 1e-9), decode_max)
        if want > decode:
            note = f"decode raised to {want} for P:D ≤ {max_ratio:g}"
            decode = want
    return prefill, decode, note
