"""One autoscaling step for an InferenceService in Planner mode: gather, decide, describe.

The kopf timer in handlers.py calls ServiceAutoscaler.step() and applies what it returns (the
Deployments' replicas through the reconciler, the status patch, an Event per change). This
module does the metrics I/O (through scrape.py or prometheus.py) and keeps the per-service
memory the planner needs between steps: its calibrated model, its behavior history, the
previous scrape. Mapping the spec onto the planner's knobs is pure (planner_config).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from phasesplit.operator import api
from phasesplit.operator.metrics.prometheus import PrometheusError, PrometheusSource
from phasesplit.operator.metrics.scrape import PodScrapeSource
from phasesplit.operator.planner import Behavior, Decision, MetricsSnapshot, Planner, PlannerConfig
from phasesplit.operator.planner.behavior import ScalingPolicy, ScalingRules
from phasesplit.operator.planner.planner import PhaseLimits


def _rules(r: api.ScalingRules) -> ScalingRules:
    return ScalingRules(float(r.stabilization_window_seconds),
                        tuple(ScalingPolicy(p.type, p.value, float(p.period_seconds)) for p in r.policies),
                        r.select_policy)


def planner_config(spec: api.InferenceServiceSpec) -> PlannerConfig:
    """The spec's SLO, bounds, ratio and behavior as the planner's knobs."""
    a = spec.autoscaling
    bounds = {p: spec.phase(p).bounds() for p in api.PHASES}
    return PlannerConfig(
        ttft_s=api.parse_duration(spec.slo.ttft),
        itl_s=api.parse_duration(spec.slo.itl),
        percentile=spec.slo.percentile / 100.0,
        prefill=PhaseLimits(*bounds["prefill"]),
        decode=PhaseLimits(*bounds["decode"]),
        behavior=Behavior(_rules(a.behavior.scale_up), _rules(a.behavior.scale_down)),
        min_pd_ratio=a.ratio.min if a.ratio else None,
        max_pd_ratio=a.ratio.max if a.ratio else None,
        interval_s=api.parse_duration(a.interval),
    )


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


def _rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).replace(microsecond=0).isoformat() \
        .replace("+00:00", "Z")


def status_patch(decision: Decision, snap: MetricsSnapshot | None, now: float, generation: int | None,
                 previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """status.autoscaling after a step (camelCase, as the CRD stores it)."""
    previous = previous or {}
    out: dict[str, Any] = {"mode": "Planner"}
    last = previous.get("lastDecision")
    if decision.changed or last is None:
        last = {"time": _rfc3339(now), "reason": decision.reason[:1000],
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
        since = before["lastTransitionTime"] if before and before.get("status") == status else _rfc3339(now)
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
    """The planner and metrics memory of one InferenceService (keyed by uid in handlers)."""

    def __init__(self, spec: api.InferenceServiceSpec):
        self.spec_key: Any = None
        self.planner: Planner | None = None
        self.pods: PodScrapeSource | None = None
        self.last_step: float | None = None
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

    def due(self, now: float) -> bool:
        assert self.planner is not None
        return self.last_step is None or now - self.last_step >= self.planner.config.interval_s - 0.5

    async def _collect(self, slices: list[Mapping[str, Any]]) -> tuple[MetricsSnapshot | None, list[str]]:
        if self.prometheus is not None:
            try:
                return await self.prometheus.collect(), []
            except PrometheusError as e:
                return None, [str(e)]
        assert self.pods is not None
        snap = await self.pods.collect(endpoint_targets(slices))
        return snap, list(self.pods.errors)

    def step(self, current: Mapping[str, int], slices: list[Mapping[str, Any]], now: float) -> StepResult:
        """slices: the EndpointSlices of the service's router and phase Services (pods source)."""
        assert self.planner is not None
        self.last_step = now
        snap, errors = asyncio.run(self._collect(slices))
        decision = self.planner.plan(snap, dict(current), now)
        return StepResult(decision, snap, errors)
