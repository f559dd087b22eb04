"""The reconcile pass over an in-memory stand-in for the operator's own `Kube` verbs.

The stand-in models what the pass relies on: apply replaces our intent, adds server defaults and
bumps the resourceVersion only when something changed (as server-side apply does), and every
call is counted. The real API server is exercised by tests/cluster/test_operator*.py.
"""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
from kubernetes.client.exceptions import ApiException

from phasesplit.operator import api, kube, reconcile, render
from phasesplit.operator.controller import Controller, Settings
from phasesplit.operator.render import PlannedReplicas

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
        self.calls: Counter[str] = Counter()
        self.events: list[tuple[str, str, str]] = []
        self.parents: list[dict] = []
        self.created: dict[tuple[str, str], dict] = {}  # create_if_absent (the internal Secret)

    def create_if_absent(self, obj):
        self.calls["create"] += 1
        if render.key(obj) in self.created:
            return False
        self.created[render.key(obj)] = copy.deepcopy(dict(obj))
        return True

    def apply(self, obj):
        self.calls["apply"] += 1
        if obj["kind"] == self.fail_kind:
            raise ApiException(status=403, reason="Forbidden")
        key = render.key(obj)
        before = self.objects.get(key)
        body = copy.deepcopy(dict(obj))
        if obj["kind"] == "Deployment":
            body["spec"]["progressDeadlineSeconds"] = 600  # a server default
        if before is None or {k: v for k, v in before.items() if k != "rv"} != body:
            self.rv += 1
            body["rv"] = self.rv
            self.objects[key] = body
        return self.view(key)

    def view(self, key):
        out = copy.deepcopy(self.objects[key])
        out["metadata"]["resourceVersion"] = str(out.pop("rv"))
        return out

    def observed(self):
        """The children as the watch would show them."""
        return {k: self.view(k) for k in self.objects}

    def edit(self, key, change):
        change(self.objects[key])
        self.rv += 1
        self.objects[key]["rv"] = self.rv

    def delete(self, kind, namespace, name):
        self.calls["delete"] += 1
        self.objects.pop((kind, name), None)

    def patch_status(self, namespace, name, new_status):
        self.calls["patch_status"] += 1
        self.statuses.append(copy.deepcopy(dict(new_status)))

    def post_event(self, owner, kind, reason, message):
        self.events.append((kind, reason, message))

    def list(self, kind, namespace, selector=None, limit=None, continue_=None):
        """What a resync lists (a pass must read the cache, never list); one page holds all."""
        self.calls["list"] += 1
        items = [self.view(key) for key in self.objects if key[0] == kind.kind]
        if kind.kind == "InferenceService":
            items = list(self.parents)
        return {"metadata": {"resourceVersion": str(self.rv)}, "items": items}


class Events(list):
    def __call__(self, kind, reason, message):
        self.append((kind, reason, message))

    def reasons(self):
        return [r for _, r, _ in self]


def sync(k: MemoryKube, spec, events, replicas=None, known=frozenset()):
    desired = render.render(OWNER, spec, replicas or render.desired_replicas(spec))
    return reconcile.reconcile_children(k, OWNER, desired, k.observed(), events, known)


def test_first_pass_creates_everything_then_is_a_no_op():
    k, events = MemoryKube(), Events()
    applied, _ = sync(k, spec_of(), events)
    assert len(applied) == len(k.objects) == 14
    assert events.reasons() == ["Created"]  # one Event naming all fourteen and the internal Secret
    assert events[0][2].count(", ") == 14 and "Deployment chat-decode" in events[0][2]
    assert "Secret chat-internal" in events[0][2]
    (secret,) = k.created.values()
    value = secret["stringData"][render.INTERNAL_SECRET_KEY]
    assert len(value) >= 32 and secret["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert value not in events[0][2]
    again = Events()
    applied, deleted = sync(k, spec_of(), again)
    assert again == [] and applied == {} and deleted == [] and k.rv == 14 and k.calls["apply"] == 14
    k.objects.pop(("Deployment", "chat-router"))  # recreating a Deployment checks the Secret again
    sync(k, spec_of(runtime={"image": "example/rt:2"}), Events())
    assert k.calls["create"] == 2
    assert k.created[("Secret", "chat-internal")]["stringData"][render.INTERNAL_SECRET_KEY] == value


def test_spec_change_updates_and_prunes():
    k, events = MemoryKube(), Events()
    sync(k, spec_of(autoscaling={"mode": "HPA"}), events)
    assert ("HorizontalPodAutoscaler", "chat-decode") in k.objects
    events.clear()
    sync(k, spec_of(autoscaling={"mode": "Disabled"}, networkPolicy={"enabled": False},
                    runtime={"image": "example/rt:2"}), events)
    assert [m for _, r, m in events if r == "Deleted"] == [
        "deleted HorizontalPodAutoscaler chat-decode, HorizontalPodAutoscaler chat-prefill, "
        "NetworkPolicy chat-decode, NetworkPolicy chat-prefill (no longer wanted by the spec)"]
    assert [m for _, r, m in events if r == "Updated"] == [
        "updated Deployment chat-prefill, Deployment chat-decode, Deployment chat-router"]
    assert k.objects[("Deployment", "chat-decode")]["spec"]["replicas"] == 2


def test_two_replica_counts_cost_two_applies():
    k, events = MemoryKube(), Events()
    spec = spec_of()
    sync(k, spec, events)
    k.calls.clear()
    events.clear()
    decision = render.desired_replicas(spec, PlannedReplicas(prefill=3, decode=4))
    applied, _ = sync(k, spec, events, decision)
    assert sorted(applied) == [("Deployment", "chat-decode"), ("Deployment", "chat-prefill")]
    assert k.calls == Counter(apply=2) and events.reasons() == ["Updated"]


def test_a_field_no_longer_rendered_is_applied_away():
    """The intent hash catches what a containment check cannot: a field we stopped sending."""
    k, events = MemoryKube(), Events()
    sync(k, spec_of(decode={"replicas": 2, "nodeSelector": {"gpu": "a100"}}), events)
    events.clear()
    sync(k, spec_of(), events)
    assert [m for _, r, m in events if r == "Updated"] == ["updated Deployment chat-decode"]
    assert "nodeSelector" not in k.objects[("Deployment", "chat-decode")]["spec"]["template"]["spec"]


def test_apply_failure_posts_a_warning_and_raises():
    k, events = MemoryKube(), Events()
    k.fail_kind = "NetworkPolicy"
    with pytest.raises(ApiException):
        sync(k, spec_of(), events)
    warnings = [m for kind, reason, m in events if (kind, reason) == ("Warning", "ApplyFailed")]
    assert [w.split(":")[0] for w in warnings] == ["NetworkPolicy chat-prefill", "NetworkPolicy chat-decode"]
    # The refusal held back nothing else.
    assert len(k.objects) == 12 and events.reasons().count("Created") == 1
    assert next(m for _, r, m in events if r == "Created").count(", ") == 12  # + the internal Secret


def test_edits_are_reverted_deleted_children_recreated_unwanted_removed():
    k, events = MemoryKube(), Events()
    spec = spec_of()
    sync(k, spec, events)
    known = set(k.objects)
    events.clear()
    # A hand edit: put back.
    k.edit(("Deployment", "chat-decode"), lambda o: o["spec"].update(replicas=7))
    sync(k, spec, events, known=known)
    assert k.objects[("Deployment", "chat-decode")]["spec"]["replicas"] == 2
    # Deleted: recreated.
    k.delete("Service", "serving", "chat-router")
    sync(k, spec, events, known=known)
    assert ("Service", "chat-router") in k.objects
    # A label changed by hand: put back.
    k.edit(("NetworkPolicy", "chat-decode"),
           lambda o: o["metadata"]["labels"].update({"app.kubernetes.io/component": "hacked"}))
    sync(k, spec, events, known=known)
    assert k.objects[("NetworkPolicy", "chat-decode")]["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"
    # Not wanted any more: removed.
    sync(k, spec_of(networkPolicy={"enabled": False}), events, known=known)
    assert ("NetworkPolicy", "chat-decode") not in k.objects
    assert events.reasons() == ["Reverted", "Recreated", "Reverted", "Deleted"]


def test_status_updates_are_not_mistaken_for_edits():
    k, events = MemoryKube(), Events()
    spec = spec_of()
    sync(k, spec, events)
    # The Deployment controller writes status (and the resourceVersion moves): nothing to do.
    k.edit(("Deployment", "chat-decode"), lambda o: o.update(status={"replicas": 2, "readyReplicas": 1}))
    k.calls.clear()
    applied, _ = sync(k, spec, Events())
    assert applied == {} and k.calls["apply"] == 0


@pytest.mark.parametrize("have,want,same", [
    ({"a": 1, "b": 2}, {"a": 1}, True),
    ({"a": 1}, {"a": 1, "b": 2}, False),
    ({"cpu": "1"}, {"cpu": 1}, True),  # a quantity comes back as a string
    ({"x": True}, {"x": "True"}, False),
    ([{"a": 1, "z": 0}], [{"a": 1}], True),
    ([{"a": 1}, {"a": 2}], [{"a": 1}], False),
    ({"s": {}}, {"s": {}}, True),
    ({}, {"publishNotReadyAddresses": False}, True),  # omitempty
    ({}, {"replicas": 0}, True),
    ({}, {"x": True}, False),
])
def test_contains(have, want, same):
    assert reconcile.contains(have, want) is same


def test_write_status_writes_only_changes():
    k = MemoryKube()
    first = reconcile.write_status(k, OWNER, {"observedGeneration": 1, "endpoint": "x"}, None)
    assert k.statuses == [{"observedGeneration": 1, "endpoint": "x"}]
    planner_owned = {**first, "autoscaling": {"mode": "Planner"}}
    again = reconcile.write_status(k, OWNER, {"observedGeneration": 1, "endpoint": "x"}, planner_owned)
    assert len(k.statuses) == 1  # nothing changed: no write
    assert again["autoscaling"] == {"mode": "Planner"}  # fields it does not own are kept
    reconcile.write_status(k, OWNER, {"observedGeneration": 2, "endpoint": "x"}, again)
    assert k.statuses[-1]["observedGeneration"] == 2


def test_api_error_message_is_extracted():
    e = ApiException(status=422, reason="Unprocessable Entity")
    e.body = json.dumps({"message": 'InferenceService "x" is invalid: spec.slo.ttft: Invalid value'})
    assert "spec.slo.ttft" in kube.api_message(e)
    e.body = "not json"
    assert kube.api_message(e) == "not json"


def test_controlled_by_checks_uid_and_controller():
    obj = {"metadata": {"ownerReferences": [{"uid": "uid-1", "controller": True}]}}
    assert reconcile.controlled_by(obj, "uid-1")
    assert not reconcile.controlled_by(obj, "uid-2")
    assert not reconcile.controlled_by({"metadata": {"ownerReferences": [{"uid": "uid-1"}]}}, "uid-1")


def test_retrying_retries_transient_errors_only():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ApiException(status=409, reason="Conflict")
        return "ok"
    assert kube.retrying(flaky, sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and sleeps == [0.2, 0.4]

    def refused():
        calls.append(1)
        raise ApiException(status=422, reason="Unprocessable Entity")
    calls.clear()
    with pytest.raises(ApiException):
        kube.retrying(refused, sleep=sleeps.append)
    assert len(calls) == 1

    def always_busy():
        raise ApiException(status=503, reason="Service Unavailable")
    with pytest.raises(ApiException):
        kube.retrying(always_busy, attempts=3, sleep=lambda _: None)


# ---------------------------------------------------------------------------------------------
# the controller's pass: events in, one status write out


def parent(generation=1, spec=None, **meta):
    return {"metadata": {"name": "chat", "namespace": "serving", "uid": "uid-1", "generation": generation,
                         "resourceVersion": "100", **meta},
            "spec": spec or MINIMAL, "status": {}}


def controller(k: MemoryKube) -> Controller:
    return Controller(k, Settings(leader_election=False))


def feed_children(c: Controller, k: MemoryKube):
    for key in list(k.objects):
        c.observe_child("MODIFIED", k.view(key))


def test_a_pass_reads_the_cache_and_writes_status_once():
    k = MemoryKube()
    c = controller(k)
    c.observe_parent(None, parent())
    assert c.queue.get(timeout=0) == ("serving", "chat")
    c._reconcile(("serving", "chat"))
    c.queue.done(("serving", "chat"))
    assert k.calls == Counter(apply=14, patch_status=1, create=1)  # create: the internal Secret
    assert [r for _, r, _ in k.events] == ["Created"]
    status = k.statuses[-1]
    assert status["observedGeneration"] == 1 and status["conditions"][0]["reason"] == "ComponentsNotReady"
    # The watch echoes our applies: nothing changed, so no pass is even queued.
    feed_children(c, k)
    assert c.queue.get(timeout=0) is None
    # A status-only update of the parent (our own write) queues nothing either.
    c.observe_parent("MODIFIED", {**parent(), "status": status})
    assert c.queue.get(timeout=0) is None


def test_planner_decision_reaches_render_in_memory():
    k = MemoryKube()
    c = controller(k)
    c.observe_parent(None, parent())
    c.queue.get(timeout=0)
    c._reconcile(("serving", "chat"))
    c.queue.done(("serving", "chat"))
    k.calls.clear()
    rec = c.records[("serving", "chat")]
    rec.decision = PlannedReplicas(prefill=3, decode=4, generation=1)
    rec.autoscaling = {"mode": "Planner", "lastDecision": {"prefillReplicas": 3, "decodeReplicas": 4}}
    c._reconcile(("serving", "chat"))
    assert k.calls == Counter(apply=2, patch_status=1)
    assert k.objects[("Deployment", "chat-prefill")]["spec"]["replicas"] == 3
    assert k.statuses[-1]["autoscaling"]["lastDecision"]["decodeReplicas"] == 4


def test_a_restart_reads_the_last_decision_back_once():
    k = MemoryKube()
    c = controller(k)
    seen = parent()
    seen["status"] = {"autoscaling": {"lastDecision": {"prefillReplicas": 2, "decodeReplicas": 3, "generation": 1}}}
    c.observe_parent(None, seen)
    c._reconcile(("serving", "chat"))
    assert k.objects[("Deployment", "chat-decode")]["spec"]["replicas"] == 3


def test_a_deleted_service_is_forgotten():
    k = MemoryKube()
    c = controller(k)
    c.observe_parent(None, parent())
    c.observe_parent("DELETED", parent())
    assert c.records == {}
    c._reconcile(("serving", "chat"))
    assert k.calls == Counter()


def test_an_invalid_spec_is_reported_once_per_generation():
    k = MemoryKube()
    c = controller(k)
    c.observe_parent(None, parent(spec={"model": {"name": "m"}}))  # no model source
    c._reconcile(("serving", "chat"))
    c._reconcile(("serving", "chat"))
    assert [r for _, r, _ in k.events] == ["InvalidSpec"] and k.calls["apply"] == 0


def test_an_earlier_versions_finalizer_is_removed():
    k = MemoryKube()
    removed = []
    k.set_finalizers = lambda ns, name, finalizers, rv: removed.append((finalizers, rv))
    c = controller(k)
    c.observe_parent(None, parent(finalizers=["serving.phasesplit.io/finalizer", "other"]))
    c._reconcile(("serving", "chat"))
    assert removed == [(["other"], "100")]


def test_a_failed_pass_is_retried_until_the_api_server_answers():
    """A child event whose pass fails (the API server unreachable) is not lost: the service comes
    back through the queue's backoff and converges once calls succeed."""
    import time

    k = MemoryKube()
    real_apply = k.apply
    down = {"until": time.monotonic() + 1.0}

    def flaky_apply(obj):
        if time.monotonic() < down["until"]:
            raise ConnectionRefusedError("the API server is down")
        return real_apply(obj)
    k.apply = flaky_apply
    k.parents = [parent()]
    c = Controller(k, Settings(leader_election=False, workers=1, resync_s=3600))
    c.queue.base_delay = 0.1
    c.start()
    try:
        deadline = time.monotonic() + 10
        while not k.statuses and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(k.objects) == 14 and k.statuses
    finally:
        c.stop()


def test_resync_finds_what_a_dropped_watch_missed():
    k = MemoryKube()
    k.parents = [parent()]
    c = controller(k)
    c.resync()
    key = c.queue.get(timeout=0)
    c._reconcile(key)
    c.queue.done(key)
    feed_children(c, k)
    # A child disappears and its DELETED event never reaches the operator.
    k.objects.pop(("Service", "chat-prefill"))
    k.rv += 1
    k.events.clear()
    c.resync()
    key = c.queue.get(timeout=0)
    c._reconcile(key)
    assert ("Service", "chat-prefill") in k.objects
    assert k.events == [("Normal", "Recreated", "recreated Service chat-prefill after it was deleted")]


def test_a_terminating_namespace_is_not_fought():
    """Children the namespace controller deletes first are not recreated over and over: the
    refusal ("being terminated") ends the pass without a retry or a status write."""
    k = MemoryKube()
    c = controller(k)
    c.observe_parent(None, parent())
    c._reconcile(("serving", "chat"))
    feed_children(c, k)
    writes = k.calls["patch_status"]

    def refuse(obj):
        e = ApiException(status=403, reason="Forbidden")
        e.body = json.dumps({"message": 'roles "chat-router" is forbidden: unable to create new content in '
                                        'namespace serving because it is being terminated'})
        raise e
    k.apply = refuse
    k.objects.pop(("Role", "chat-router"))
    c.observe_child("DELETED", {"kind": "Role", "metadata": {"name": "chat-router", "namespace": "serving",
                                                             "labels": {render.INSTANCE_LABEL: "chat"}}})
    c._reconcile(("serving", "chat"))  # returns: no exception, so no retry
    assert k.calls["patch_status"] == writes


class GenerationKube(MemoryKube):
    """Shows metadata.generation as the API server does on the kinds that have one (a spec edit
    moves it: edits here set "generation" in the stored object)."""

    GENERATIONS = {"Deployment", "PodDisruptionBudget", "NetworkPolicy", "HorizontalPodAutoscaler"}

    def view(self, key):
        out = super().view(key)
        generation = out.pop("generation", 1)
        if key[0] in self.GENERATIONS:
            out["metadata"]["generation"] = generation
        return out


def converged(k: MemoryKube) -> Controller:
    """A controller whose one service is applied and whose watch has echoed every child."""
    c = controller(k)
    c.observe_parent(None, parent())
    c._reconcile(c.queue.get(timeout=0))  # applies, and compares each child once
    c.queue.done(("serving", "chat"))
    feed_children(c, k)
    assert c.queue.get(timeout=0) is None  # the echoes changed nothing
    return c


def test_a_status_only_update_queues_a_pass_only_when_status_reads_it():
    k = GenerationKube()
    c = converged(k)
    k.calls.clear()
    # A PodDisruptionBudget's counts move: no pass reads them.
    k.edit(("PodDisruptionBudget", "chat-decode"), lambda o: o.update(status={"currentHealthy": 1}))
    c.observe_child("MODIFIED", k.view(("PodDisruptionBudget", "chat-decode")))
    assert c.queue.get(timeout=0) is None
    # A Deployment's ready replicas move: the service's status reads them.
    k.edit(("Deployment", "chat-decode"),
           lambda o: o.update(status={"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1}))
    c.observe_child("MODIFIED", k.view(("Deployment", "chat-decode")))
    assert c.queue.get(timeout=0) == ("serving", "chat")
    c._reconcile(("serving", "chat"))
    assert k.calls["apply"] == 0
    assert k.statuses[-1]["decode"]["readyReplicas"] == 2


def test_a_child_found_in_place_is_still_reverted_after_an_edit():
    """A pass leaves out children it found in place at that content before; an edit is new
    content (a spec edit moves the generation, a label edit the metadata), so it is compared."""
    k = GenerationKube()
    c = converged(k)
    c._reconcile(("serving", "chat"))  # a resync's pass: nothing new
    assert len(c.records[("serving", "chat")].settled) == 14
    k.edit(("Deployment", "chat-decode"), lambda o: (o["spec"].update(replicas=7), o.update(generation=2)))
    c.observe_child("MODIFIED", k.view(("Deployment", "chat-decode")))
    k.edit(("Role", "chat-router"), lambda o: o["metadata"]["labels"].update({"app.kubernetes.io/component": "x"}))
    c.observe_child("MODIFIED", k.view(("Role", "chat-router")))  # no generation: every update may be an edit
    k.calls.clear()
    c._reconcile(("serving", "chat"))
    assert k.calls["apply"] == 2
    assert k.objects[("Deployment", "chat-decode")]["spec"]["replicas"] == 2
    assert k.objects[("Role", "chat-router")]["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
