"""Scaling policies the simulator compares: the planner, static counts, and HPA on one queue metric."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from phasesplit.operator.api import Behavior
from phasesplit.operator.planner import HPA_BEHAVIOR, PerfModel, Planner, PlannerConfig
from phasesplit.operator.planner.behavior import PhaseLimiter
from phasesplit.operator.planner.snapshot import MetricsSnapshot
from phasesplit.operator.sim.profile import SimProfile


def planner_model(p: SimProfile, prior_scale: float = 1.0) -> PerfModel:
    """The planner's prior from a profile; prior_scale ≠ 1 makes it wrong on purpose (the
    planner must then calibrate its way to the truth from metrics)."""
    pre, dec = p.prefill_profile, p.decode_profile
    return PerfModel(
        replace(pre, tokens_per_s=pre.tokens_per_s * prior_scale),
        replace(dec, base_s=dec.base_s / prior_scale, per_seq_s=dec.per_seq_s / prior_scale,
                per_token_s=dec.per_token_s / prior_scale))


@dataclass
class PlannerPolicy:
    planner: Planner
    log: list[tuple[float, str]] = field(default_factory=list)

    def __call__(self, snap: MetricsSnapshot, current: dict[str, int], now: float) -> dict[str, int]:
        d = self.planner.plan(snap, current, now)
        if d.changed:
            self.log.append((now, d.reason))
        return d.desired


@dataclass
class StaticPolicy:
    prefill: int
    decode: int

    def __call__(self, snap: MetricsSnapshot, current: dict[str, int], now: float) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode}


@dataclass
class SchedulePolicy:
    """Fixed counts that change at given times: a clairvoyant bound, not an autoscaler.

    `steps` is [(from time s, prefill, decode)], sorted. A step at time t takes effect at the
    first interval tick at or after t (an order, like any policy's; replicas still take the
    profile's start-up to be ready). Used to ask what any reactive planner could at best reach,
    e.g. one that orders the right counts at the first tick a burst is visible.
    """

    steps: list[tuple[float, int, int]]

    def __call__(self, snap: MetricsSnapshot, current: dict[str, int], now: float) -> dict[str, int]:
        _, p, d = max((s for s in self.steps if s[0] <= now), key=lambda s: s[0], default=self.steps[0])
        return {"prefill": p, "decode": d}


def parse_schedule(text: str) -> list[tuple[float, int, int]]:
    """'0:3+1,165:12+8,405:5+3' → [(0, 3, 1), (165, 12, 8), (405, 5, 3)] (seconds: prefill+decode)."""
    steps = []
    for part in text.split(","):
        at, sep, counts = part.partition(":")
        p, plus, d = counts.partition("+")
        if not sep or not plus:
            raise ValueError(f"bad schedule step {part.strip()!r}: use SECONDS:PREFILL+DECODE")
        steps.append((float(at), int(p), int(d)))
    if not steps or min(min(p, d) for _, p, d in steps) < 1:
        raise ValueError("replica counts must be ≥ 1")
    return sorted(steps)


@dataclass
class HpaQueuePolicy:
    """What an autoscaling/v2 HPA does with one Pods metric per phase Deployment: the average
    number of requests waiting per pod (prefill queue; decode requests blocked on KV), target
    `target` per pod, 10 % tolerance, default behavior (5 min scale-down stabilization)."""

    target: float
    max_replicas: int
    behavior: Behavior = field(default_factory=lambda: HPA_BEHAVIOR)
    tolerance: float = 0.1

    def __post_init__(self) -> None:
        self.limiters = {p: PhaseLimiter(self.behavior) for p in ("prefill", "decode")}

    def __call__(self, snap: MetricsSnapshot, current: dict[str, int], now: float) -> dict[str, int]:
        out = {}
        for phase, waiting in (("prefill", snap.prefill_waiting), ("decode", snap.decode_waiting)):
            # Pods still starting report nothing; on scale-up the HPA counts them as 0, so the
            # average is over all current pods and desired = ceil(total / target).
            ratio = (waiting or 0.0) / current[phase] / self.target
            rec = current[phase] if abs(ratio - 1) <= self.tolerance else math.ceil(current[phase] * ratio)
            out[phase], _ = self.limiters[phase].apply(now, current[phase], rec, 1, self.max_replicas)
        return out


def make_planner(p: SimProfile, ttft: float, itl: float, percentile: float, max_replicas: int,
                 interval: float, prior_scale: float = 1.0, idle_after: float | None = None) -> PlannerPolicy:
    """The planner as the operator configures it; idle_after: scale to zero (min 0 per phase)."""
    from phasesplit.operator.planner.planner import PhaseLimits

    low = 0 if idle_after is not None else 1

    # The reaction time is the slower phase's start-up (a burst needs both phases), as the
    # operator feeds the planner its measured start-up.
    cfg = PlannerConfig(ttft_s=ttft, itl_s=itl, percentile=percentile, interval_s=interval,
                        prefill=PhaseLimits(low, max_replicas), decode=PhaseLimits(low, max_replicas),
                        startup_s=max(p.startup("prefill"), p.startup("decode")), idle_after_s=idle_after)
    return PlannerPolicy(Planner(cfg, planner_model(p, prior_scale)))
