"""Pure status computation: the children's observed state in, the InferenceService status out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phasesplit.operator import api
from phasesplit.operator.render import Owner

CONDITION_TYPES = {"prefill": "PrefillReady", "decode": "DecodeReady", "router": "RouterReady"}


def deployment_summary(body: Mapping[str, Any]) -> dict[str, int]:
    """The few numbers of a Deployment that status needs (kept in the operator's index)."""
    spec, status, meta = body.get("spec") or {}, body.get("status") or {}, body.get("metadata") or {}
    return {
        "desired": int(spec.get("replicas", 1)),
        "replicas": int(status.get("replicas") or 0),
        "ready": int(status.get("readyReplicas") or 0),
        "updated": int(status.get("updatedReplicas") or 0),
        "generation": int(meta.get("generation") or 0),
        "observedGeneration": int(status.get("observedGeneration") or 0),
    }


def component_state(component: str, summary: Mapping[str, int] | None,
                    scales_to_zero: bool = False) -> tuple[bool, str, str]:
    """(ready, reason, message) of one component's Deployment. scales_to_zero: the planner may put
    this phase at zero (scaleToZero): at zero it is asleep, not broken."""
    if summary is None:
        return False, "DeploymentMissing", "the Deployment does not exist yet"
    desired, ready = summary["desired"], summary["ready"]
    if summary["observedGeneration"] < summary["generation"]:
        return False, "Progressing", "the Deployment controller has not seen the latest spec yet"
    if desired == 0:
        if scales_to_zero:
            return True, "ScaledToZero", ("scaled to zero: the router holds requests and the planner wakes "
                                          f"the {component} pool for them")
        # No prefill workers is a working (if slower) service: decode workers prefill locally.
        if component == "prefill":
            return True, "ScaledToZero", "no prefill workers; decode workers prefill locally"
        return False, "ScaledToZero", f"no {component} replicas"
    if summary["updated"] < desired or summary["replicas"] > desired:
        # Old pods still running (scale-down or rollout in flight) count as not settled.
        return False, "Progressing", (f"rolling out: {summary['updated']}/{desired} replicas updated, "
                                      f"{summary['replicas']} running")
    if ready < desired:
        return False, "ReplicasNotReady", f"{ready}/{desired} replicas ready"
    return True, "Available", f"{ready}/{desired} replicas ready"


def endpoint(owner: Owner, spec: api.InferenceServiceSpec) -> str:
    port = spec.router.service.port
    suffix = "" if port == 80 else f":{port}"
    return f"http://{owner.child('router')}.{owner.namespace}.svc{suffix}"


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int | None,
               previous: Mapping[str, Mapping[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = previous.get(kind)
    # lastTransitionTime moves only when the status flips, as metav1.Condition requires.
    since = before["lastTransitionTime"] if before and before.get("status") == status else now
    cond = {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def compute_status(owner: Owner, spec: api.InferenceServiceSpec, deployments: Mapping[str, Mapping[str, int]],
                   previous: Mapping[str, Any] | None, now: str, observed_generation: int | None,
                   error: str | None = None, startup: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The status fields the operator owns (status.autoscaling belongs to the planner).

    previous: the current status, for condition transition times; now: RFC 3339 timestamp;
    error: why the last reconcile failed, if it did (makes Ready False with ReconcileFailed);
    startup: each phase's measured start-up, seconds (startup.py), where one was measured.
    """
    prev_conditions = {c["type"]: c for c in (previous or {}).get("conditions", []) if "type" in c}
    status: dict[str, Any] = {"endpoint": endpoint(owner, spec)}
    if observed_generation is not None:
        status["observedGeneration"] = observed_generation
    conditions = []
    not_ready = []
    a = spec.autoscaling
    zero = {p for p in api.PHASES if a.mode == "Planner" and a.scale_to_zero and spec.phase(p).bounds()[0] == 0}
    for component in api.COMPONENTS:
        summary = deployments.get(component)
        ok, reason, message = component_state(component, summary, component in zero)
        desired = summary["desired"] if summary else 0
        ready = summary["ready"] if summary else 0
        status[component] = {"replicas": summary["replicas"] if summary else 0, "readyReplicas": ready,
                             "desiredReplicas": desired, "summary": f"{ready}/{desired}"}
        if startup and component in startup:
            status[component]["startupSeconds"] = round(startup[component], 1)
        conditions.append(_condition(CONDITION_TYPES[component], ok, reason, message, observed_generation,
                                     prev_conditions, now))
        if not ok:
            not_ready.append(f"{component}: {message}")
    if error:
        ready = (False, "ReconcileFailed", error)
    elif not_ready:
        ready = (False, "ComponentsNotReady", "; ".join(not_ready))
    else:
        ready = (True, "Ready", f"serving at {status['endpoint']}")
    conditions.insert(0, _condition("Ready", *ready, observed_generation, prev_conditions, now))
    status["conditions"] = conditions
    return status


def same_status(current: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether patching `new` would change nothing (so no write, no event storm)."""
    current = current or {}
    return all(current.get(k) == v for k, v in new.items())
