"""Pure status computation from Deployment summaries."""

from __future__ import annotations

from phasesplit.operator import api, render, status

OWNER = render.Owner(name="chat", namespace="serving", uid="uid-1")
SPEC = api.InferenceServiceSpec.model_validate({"model": {"name": "m", "builtin": "smollm2"},
                                                "decode": {"replicas": 2}})
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def summary(desired, ready, updated=None, generation=2, observed=2):
    return {"desired": desired, "replicas": desired, "ready": ready,
            "updated": desired if updated is None else updated, "generation": generation,
            "observedGeneration": observed}


def conditions(st):
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


ALL_READY = {"prefill": summary(1, 1), "decode": summary(2, 2), "router": summary(1, 1)}


def test_all_ready():
    st = status.compute_status(OWNER, SPEC, ALL_READY, None, T0, observed_generation=3)
    assert conditions(st) == {"Ready": ("True", "Ready"), "PrefillReady": ("True", "Available"),
                              "DecodeReady": ("True", "Available"), "RouterReady": ("True", "Available")}
    assert st["observedGeneration"] == 3
    assert st["decode"] == {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2, "summary": "2/2"}
    assert st["endpoint"] == "http://chat-router.serving.svc"
    assert [c["type"] for c in st["conditions"]] == ["Ready", "PrefillReady", "DecodeReady", "RouterReady"]


def test_endpoint_names_a_non_default_port():
    spec = SPEC.model_copy(update={"router": api.RouterSpec(service=api.RouterServiceSpec(port=8080))})
    assert status.endpoint(OWNER, spec) == "http://chat-router.serving.svc:8080"


def test_not_ready_reasons():
    cases = {
        None: "DeploymentMissing",
        "stale": "Progressing",
        "rolling": "Progressing",
        "waiting": "ReplicasNotReady",
        "old-pods-left": "Progressing",
    }
    deps = dict(ALL_READY)
    for case, reason in cases.items():
        if case is None:
            deps.pop("decode", None)
        elif case == "stale":
            deps["decode"] = summary(2, 2, generation=3, observed=2)
        elif case == "rolling":
            deps["decode"] = summary(2, 2, updated=1)
        elif case == "waiting":
            deps["decode"] = summary(2, 1)
        else:
            deps["decode"] = dict(summary(2, 3), replicas=3)
        st = status.compute_status(OWNER, SPEC, deps, None, T0, 1)
        assert conditions(st)["DecodeReady"] == ("False", reason), case
        assert conditions(st)["Ready"] == ("False", "ComponentsNotReady")
        assert "decode:" in st["conditions"][0]["message"]


def test_zero_prefill_is_ready_zero_decode_is_not():
    deps = dict(ALL_READY, prefill=summary(0, 0))
    assert conditions(status.compute_status(OWNER, SPEC, deps, None, T0, 1))["Ready"] == ("True", "Ready")
    deps = dict(ALL_READY, decode=summary(0, 0))
    st = status.compute_status(OWNER, SPEC, deps, None, T0, 1)
    assert conditions(st)["DecodeReady"] == ("False", "ScaledToZero")


def test_transition_time_moves_only_on_flips():
    first = status.compute_status(OWNER, SPEC, ALL_READY, None, T0, 1)
    same = status.compute_status(OWNER, SPEC, ALL_READY, first, T1, 1)
    assert all(c["lastTransitionTime"] == T0 for c in same["conditions"])
    assert status.same_status(first, same)
    flipped = status.compute_status(OWNER, SPEC, dict(ALL_READY, router=summary(1, 0)), first, T1, 1)
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times == {"Ready": T1, "PrefillReady": T0, "DecodeReady": T0, "RouterReady": T1}
    assert not status.same_status(first, flipped)


def test_reconcile_error_makes_ready_false():
    st = status.compute_status(OWNER, SPEC, ALL_READY, None, T0, 1, error="403 Forbidden: no")
    assert conditions(st)["Ready"] == ("False", "ReconcileFailed")
    assert st["conditions"][0]["message"] == "403 Forbidden: no"


def test_same_status_ignores_fields_it_does_not_own():
    st = status.compute_status(OWNER, SPEC, ALL_READY, None, T0, 1)
    current = dict(st, autoscaling={"mode": "Planner"})
    assert status.same_status(current, st)


def test_deployment_summary():
    body = {"metadata": {"generation": 4}, "spec": {"replicas": 3},
            "status": {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3, "observedGeneration": 4}}
    assert status.deployment_summary(body) == {"desired": 3, "replicas": 3, "ready": 2, "updated": 3,
                                               "generation": 4, "observedGeneration": 4}
    assert status.deployment_summary({"metadata": {}, "spec": {}})["ready"] == 0


def test_measured_startup_shows_per_phase():
    st = status.compute_status(OWNER, SPEC, ALL_READY, None, T0, 1, startup={"prefill": 4.0, "decode": 12.25})
    assert st["prefill"]["startupSeconds"] == 4.0 and st["decode"]["startupSeconds"] == 12.2
    assert "startupSeconds" not in st["router"]
    assert "startupSeconds" not in status.compute_status(OWNER, SPEC, ALL_READY, None, T0, 1)["prefill"]
    api.InferenceServiceStatus.model_validate(st)  # the CRD's status schema has the field


def test_at_zero_a_scale_to_zero_service_is_ready_and_says_so():
    zero = api.InferenceServiceSpec.model_validate({
        "model": {"name": "m", "builtin": "smollm2"}, "prefill": {"replicas": 1, "minReplicas": 0},
        "decode": {"replicas": 1, "minReplicas": 0}, "autoscaling": {"scaleToZero": {"idleAfter": "1m"}}})
    asleep = dict(ALL_READY, prefill=summary(0, 0), decode=summary(0, 0))
    st = status.compute_status(OWNER, zero, asleep, None, T0, 1)
    assert conditions(st) == {"Ready": ("True", "Ready"), "PrefillReady": ("True", "ScaledToZero"),
                              "DecodeReady": ("True", "ScaledToZero"), "RouterReady": ("True", "Available")}
    # Without scaleToZero a decode pool at zero serves nothing: not ready.
    assert conditions(status.compute_status(OWNER, SPEC, asleep, None, T0, 1))["DecodeReady"] == (
        "False", "ScaledToZero")
