"""Reconcile orchestration over an in-memory stand-in for the operator's own `Kube` verbs.

The stand-in models what these functions rely on: apply replaces our intent and bumps the
resourceVersion only when something changed (as server-side apply does). The real API server is
exercised by tests/cluster/test_operator*.py.
"""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes.client.exceptions import ApiException

from phasesplit.operator import api, reconcile, render

OWNER = render.Owner(name="chat", namespace="serving", uid="uid-1")
MINIMAL = {"model": {"name": "m", "builtin": "smollm2"}, "decode": {"replicas": 2}}


def spec_of(**patch) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({**copy.deepcopy(MINIMAL), **patch})


class MemoryKube:
    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.rv = 0
        self.fail_kind: str | None = None
        self.statuses: list[dict] = []

    def apply(self, obj):
        if obj["kind"] == self.fail_kind:
            raise ApiException(status=403, reason="Forbidden")
        key = render.key(obj)
        before = self.objects.get(key)
        body = copy.deepcopy(dict(obj))
        if before is None or {k: v for k, v in before.items() if k != "rv"} != body:
            self.rv += 1
            body["rv"] = self.rv
            self.objects[key] = body
        out = copy.deepcopy(self.objects[key])
        out["metadata"]["resourceVersion"] = str(out.pop("rv"))
        return out

    def list_children(self, owner):
        return {k: self._view(k) for k in self.objects}

    def _view(self, key):
        out = copy.deepcopy(self.objects[key])
        out["metadata"]["resourceVersion"] = str(out.pop("rv"))
        return out

    def delete(self, kind, namespace, name):
        self.objects.pop((kind, name), None)

    def patch_status(self, namespace, name, new_status):
        self.statuses.append(copy.deepcopy(dict(new_status)))


class Events(list):
    def __call__(self, kind, reason, message):
        self.append((kind, reason, message))

    def reasons(self):
        return [r for _, r, _ in self]


def test_first_sync_creates_everything_then_is_a_no_op():
    kube, events = MemoryKube(), Events()
    spec = spec_of()
    applied = reconcile.sync_children(kube, OWNER, spec, render.desired_replicas(spec), events)
    assert len(applied) == len(kube.objects) == 14
    assert events.reasons() == ["Created"] * 14
    again = Events()
    reconcile.sync_children(kube, OWNER, spec, render.desired_replicas(spec), again)
    assert again == [] and kube.rv == 14


def test_spec_change_updates_and_prunes():
    kube, events = MemoryKube(), Events()
    hpa = spec_of(autoscaling={"mode": "HPA"})
    reconcile.sync_children(kube, OWNER, hpa, render.desired_replicas(hpa), events)
    assert ("HorizontalPodAutoscaler", "chat-decode") in kube.objects
    events.clear()
    plain = spec_of(autoscaling={"mode": "Disabled"}, networkPolicy={"enabled": False},
                    runtime={"image": "example/rt:2"})
    reconcile.sync_children(kube, OWNER, plain, render.desired_replicas(plain), events)
    assert sorted(m for _, r, m in events if r == "Deleted") == [
        "deleted HorizontalPodAutoscaler chat-decode (no longer wanted by the spec)",
        "deleted HorizontalPodAutoscaler chat-prefill (no longer wanted by the spec)",
        "deleted NetworkPolicy chat-decode (no longer wanted by the spec)",
        "deleted NetworkPolicy chat-prefill (no longer wanted by the spec)",
    ]
    assert sorted(m for _, r, m in events if r == "Updated") == [
        "updated Deployment chat-decode", "updated Deployment chat-prefill", "updated Deployment chat-router"]
    assert kube.objects[("Deployment", "chat-decode")]["spec"]["replicas"] == 2


def test_apply_failure_posts_a_warning_and_raises():
    kube, events = MemoryKube(), Events()
    kube.fail_kind = "NetworkPolicy"
    spec = spec_of()
    with pytest.raises(ApiException):
        reconcile.sync_children(kube, OWNER, spec, render.desired_replicas(spec), events)
    warnings = [m for kind, reason, m in events if (kind, reason) == ("Warning", "ApplyFailed")]
    assert [w.split(":")[0] for w in warnings] == ["NetworkPolicy chat-prefill", "NetworkPolicy chat-decode"]
    # The refusal held back nothing else.
    assert len(kube.objects) == 12 and events.reasons().count("Created") == 12


def test_sync_child_reverts_recreates_and_removes():
    kube, events = MemoryKube(), Events()
    spec = spec_of()
    replicas = render.desired_replicas(spec)
    reconcile.sync_children(kube, OWNER, spec, replicas, events)
    events.clear()
    # Unchanged: the event showed exactly what we applied.
    seen = kube._view(("Deployment", "chat-decode"))
    assert reconcile.sync_child(kube, OWNER, spec, replicas, "Deployment", "chat-decode", seen, events) == "unchanged"
    # A hand edit: put back.
    kube.objects[("Deployment", "chat-decode")]["spec"]["replicas"] = 7
    kube.rv += 1
    kube.objects[("Deployment", "chat-decode")]["rv"] = kube.rv
    seen = kube._view(("Deployment", "chat-decode"))
    assert reconcile.sync_child(kube, OWNER, spec, replicas, "Deployment", "chat-decode", seen, events) == "reverted"
    assert kube.objects[("Deployment", "chat-decode")]["spec"]["replicas"] == 2
    # Deleted: recreated.
    kube.delete("Service", "serving", "chat-router")
    assert reconcile.sync_child(kube, OWNER, spec, replicas, "Service", "chat-router", None, events) == "recreated"
    assert ("Service", "chat-router") in kube.objects
    # Not wanted any more: removed.
    off = spec_of(networkPolicy={"enabled": False})
    seen = kube._view(("NetworkPolicy", "chat-decode"))
    assert reconcile.sync_child(kube, OWNER, off, replicas, "NetworkPolicy", "chat-decode", seen, events) == "deleted"
    assert events.reasons() == ["Reverted", "Recreated", "Deleted"]


def test_sync_status_writes_only_changes():
    kube = MemoryKube()
    spec = spec_of()
    deps = {c: {"desired": 1, "replicas": 1, "ready": 1, "updated": 1, "generation": 1, "observedGeneration": 1}
            for c in api.COMPONENTS}
    first = reconcile.sync_status(kube, OWNER, spec, deps, None, "2026-01-01T00:00:00Z", 1)
    assert kube.statuses == [first]
    planner_owned = {**first, "autoscaling": {"mode": "Planner"}}
    again = reconcile.sync_status(kube, OWNER, spec, deps, planner_owned, "2026-01-01T00:05:00Z", 1)
    assert len(kube.statuses) == 1  # nothing changed: no write
    assert again["autoscaling"] == {"mode": "Planner"}  # fields it does not own are kept
    reconcile.sync_status(kube, OWNER, spec, deps, again, "2026-01-01T00:06:00Z", 2)
    assert kube.statuses[-1]["observedGeneration"] == 2


def test_api_error_message_is_extracted():
    e = ApiException(status=422, reason="Unprocessable Entity")
    e.body = json.dumps({"message": 'InferenceService "x" is invalid: spec.slo.ttft: Invalid value'})
    assert "spec.slo.ttft" in reconcile._message(e)
    e.body = "not json"
    assert reconcile._message(e) == "not json"


def test_controlled_by_checks_uid_and_controller():
    obj = {"metadata": {"ownerReferences": [{"uid": "uid-1", "controller": True}]}}
    assert reconcile._controlled_by(obj, "uid-1")
    assert not reconcile._controlled_by(obj, "uid-2")
    assert not reconcile._controlled_by({"metadata": {"ownerReferences": [{"uid": "uid-1"}]}}, "uid-1")


def test_status_updates_are_not_mistaken_for_edits():
    seen = {"metadata": {"generation": 3, "resourceVersion": "10", "labels": {"a": "b"}}}
    status_moved = {"metadata": {"generation": 3, "resourceVersion": "14", "labels": {"a": "b"}}}
    assert reconcile._fingerprint(seen) == reconcile._fingerprint(status_moved)
    spec_moved = {"metadata": {"generation": 4, "resourceVersion": "15", "labels": {"a": "b"}}}
    label_moved = {"metadata": {"generation": 3, "resourceVersion": "16", "labels": {"a": "c"}}}
    assert reconcile._fingerprint(seen) != reconcile._fingerprint(spec_moved)
    assert reconcile._fingerprint(seen) != reconcile._fingerprint(label_moved)
    no_generation = {"metadata": {"resourceVersion": "7"}}
    assert reconcile._fingerprint(no_generation) != reconcile._fingerprint({"metadata": {"resourceVersion": "8"}})


def test_retrying_retries_transient_errors_only():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ApiException(status=409, reason="Conflict")
        return "ok"
    assert reconcile.retrying(flaky, sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and sleeps == [0.2, 0.4]

    def refused():
        calls.append(1)
        raise ApiException(status=422, reason="Unprocessable Entity")
    calls.clear()
    with pytest.raises(ApiException):
        reconcile.retrying(refused, sleep=sleeps.append)
    assert len(calls) == 1

    def always_busy():
        raise ApiException(status=503, reason="Service Unavailable")
    with pytest.raises(ApiException):
        reconcile.retrying(always_busy, attempts=3, sleep=lambda _: None)
