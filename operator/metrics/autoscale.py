"""One autoscaling step for an InferenceService in Planner mode: gather, decide, describe.

The controller's planner loop (controller.py) awaits ServiceAutoscaler.step() when a service's
interval has passed and hands the decision to that service's next reconcile pass in memory.
This module does the metrics I/O (through scrape.py or prometheus.py) and keeps the per-service
memory the planner needs between steps: its calibrated model, its behavior history, the
previous scrape. Mapping the spec onto the planner's knobs is pure (planner_config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from phasesplit.operator import api
from phasesplit.operator.metrics.prometheus import PrometheusError, PrometheusSource
from phasesplit.operator.metrics.scrape import PodScrapeSource
from phasesplit.operator.planner import Decision, MetricsSnapshot, Planner, PlannerConfig
from phasesplit.operator.planner.planner import PhaseLimits
from phasesplit.runtime.units import parse_duration, rfc3339


def planner_config(spec: api.InferenceServiceSpec) -> PlannerConfig:
    """The spec's SLO, bounds, ratio and behavior as the planner's knobs."""
    a = spec.autoscaling
    bounds = {p: spec.phase(p).bounds() for p in api.PHASES}
    return PlannerConfig(
        ttft_s=parse_duration(spec.slo.ttft),
        itl_s=parse_duration(spec.slo.itl),
        percentile=spec.slo.percentile / 100.0,
        prefill=PhaseLimits(*bounds["prefill"]),
        decode=PhaseLimits(*bounds["decode"]),
        behavior=a.behavior,
        min_pd_ratio=a.ratio.min if a.ratio else None,
        max_pd_ratio=a.ratio.max if a.ratio else None,
        interval_s=parse_duration(a.interval),
        # Scale to zero: the router holds the requests that find no worker (its held count, in
        # the snapshot, wakes the phases); without scaleToZero minReplicas 0 means 1.
        idle_after_s=parse_duration(a.scale_to_zero.idle_after) if a.scale_to_zero else None,
        # Decode may prefill prompts itself (short ones, or any under adaptive placement when no
        # prefill worker is ready): a held request then needs decode alone.
        local_prefill=spec.decode.local_prefill_threshold > 0 or spec.decode.prefill_placement == "Adaptive",
    )


def reaction_startup(startup: Mapping[str, float]) -> float:
    """The start-up the planner reacts with: the slower measured phase."""
    return max(startup.get(p, 0.0) for p in api.PHASES)


def endpoint_targets(slices: list[Mapping[str, Any]]) -> dict[str, str]:
    """/metrics URLs of the ready endpoints in the router's and phases' EndpointSlices (what the
    router itself discovers workers from; an endpoint not ready reports nothing, as Prometheus's
    up=0 would)."""
    out = {}
    for sl in slices:
        port = next((p.get("port") for p in sl.get("ports") or [] if p.get("name") == "http"), None)
        if port is None:
            continue
        for ep in sl.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False or not ep.get("addresses"):
                continue
            address = ep["addresses"][0]
            host = f"[{address}]" if ":" in address else address
            name = (ep.get("targetRef") or {}).get("name") or address
            out[name] = f"http://{host}:{port}/metrics"
    return out


def status_patch(decision: Decision, snap: MetricsSnapshot | None, now: float, generation: int | None,
                 previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """status.autoscaling after a step (camelCase, as the CRD stores it)."""
    previous = previous or {}
    out: dict[str, Any] = {"mode": "Planner"}
    last = previous.get("lastDecision")
    if decision.changed or last is None:
        last = {"time": rfc3339(now), "reason": decision.reason[:1000],
                "prefillReplicas": decision.prefill.desired, "decodeReplicas": decision.decode.desired,
                "generation": generation}
    out["lastDecision"] = last
    if snap is not None and not decision.stale:
        out["observed"] = {"ttftSeconds": snap.ttft_p, "itlSeconds": snap.itl_p,
                           "requestRate": snap.request_rate, "attainment": snap.slo_attainment}
    elif "observed" in previous:
        out["observed"] = previous["observed"]
    prev_conds = {c["type"]: c for c in previous.get("conditions") or []}
    conds = []
    for kind, ok, reason, message in decision.conditions:
        status = "True" if ok else "False"
        before = prev_conds.get(kind)
        since = before["lastTransitionTime"] if before and before.get("status") == status else rfc3339(now)
        conds.append({"type": kind, "status": status, "reason": reason, "message": message[:1000],
                      "lastTransitionTime": since})
    out["conditions"] = conds
    return out


@dataclass
class StepResult:
    decision: Decision
    snapshot: MetricsSnapshot | None
    errors: list[str]


class ServiceAutoscaler:
    """The planner and metrics memory of one InferenceService (kept in the controller's record)."""

    # Endpoints that all failed are left alone for the next 1, 2, 4 ... up to this many intervals
    # (until the endpoints change): an unreachable pool costs nothing every interval.
    MAX_BACKOFF_INTERVALS = 8

    def __init__(self, spec: api.InferenceServiceSpec):
        self.spec_key: Any = None
        self.planner: Planner | None = None
        self.pods: PodScrapeSource | None = None
        self.prometheus: PrometheusSource | None = None
        self.last_step: float | None = None
        self._failed_targets: dict[str, str] | None = None
        self._failures = 0
        self._skip_until = 0.0
        self.configure(spec)

    def configure(self, spec: api.InferenceServiceSpec) -> None:
        """(Re)build on a spec change; the calibrated model survives, the behavior history too
        when only numbers changed (a fresh history would block scale-down for one window)."""
        key = spec.model_dump_json(include={"slo", "autoscaling", "prefill", "decode"})
        if key == self.spec_key:
            return
        cfg = planner_config(spec)
        if self.planner is None:
            self.planner = Planner(cfg)
        else:
            self.planner.config = cfg
            for limiter in self.planner.limiters.values():
                limiter.behavior = cfg.behavior
        slo = (cfg.ttft_s, cfg.itl_s)
        self.pods = PodScrapeSource(cfg.percentile, slo=slo)
        self.prometheus = None
        m = spec.autoscaling.metrics
        if m.source == "prometheus" and m.url:
            self.prometheus = PrometheusSource(m.url, spec.model.name, window_s=cfg.interval_s,
                                               percentile=cfg.percentile, slo=slo)
        self.spec_key = key

    @property
    def interval_s(self) -> float:
        assert self.planner is not None
        return self.planner.config.interval_s

    def due(self, now: float) -> bool:
        return self.last_step is None or now - self.last_step >= self.interval_s - 0.5

    async def _collect(self, targets: dict[str, str], now: float,
                       http: httpx.AsyncClient | None) -> tuple[MetricsSnapshot | None, list[str]]:
        if self.prometheus is not None:
            try:
                return await self.prometheus.collect(), []
            except PrometheusError as e:
                return None, [str(e)]
        assert self.pods is not None
        if not targets:
            return None, []  # no ready endpoint: nothing to ask
        if targets == self._failed_targets and now < self._skip_until:
            return None, []  # the same endpoints failed last time: back off
        snap = await self.pods.collect(targets, http)
        errors = list(self.pods.errors)
        if errors and len(errors) == len(targets):
            self._failures = self._failures + 1 if targets == self._failed_targets else 1
            self._failed_targets = targets
            skip = min(2 ** (self._failures - 1), self.MAX_BACKOFF_INTERVALS)
            self._skip_until = now + self.interval_s * (skip + 0.5)
        else:
            self._failed_targets, self._failures = None, 0
        return snap, errors

    async def step(self, current: Mapping[str, int], targets: dict[str, str], now: float,
                   http: httpx.AsyncClient | None = None, startup: Mapping[str, float] | None = None) -> StepResult:
        """targets: /metrics URLs of the ready endpoints (pods source; see endpoint_targets);
        http: a client to scrape them with (default: one for this step); startup: the phases'
        measured start-up (the controller's rolling medians), the planner's reaction time."""
        assert self.planner is not None
        self.last_step = now
        if startup:
            # The slower phase decides when a pair ordered now can serve (as the simulator does).
            self.planner.use_startup(reaction_startup(startup))
        snap, errors = await self._collect(targets, now, http)
        decision = self.planner.plan(snap, dict(current), now)
        return StepResult(decision, snap, errors)
