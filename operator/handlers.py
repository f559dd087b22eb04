"""kopf wiring only: which events call which reconcile step. Logic lives in render/status/reconcile.

- InferenceService create/update/resume: apply all children, prune, write status.
- Any child event (watched, never polled): put that one child back as the spec wants it
  (drift correction, recreation after deletion) and, for Deployments, refresh the status.
- Indexes keep the latest InferenceServices and Deployment summaries in memory, so child events
  need no extra reads.
- A timer per InferenceService in Planner mode runs the autoscaler every autoscaling.interval
  (metrics, planner and status in phasesplit.operator.metrics.autoscale) and applies its decision.

Handlers are sync functions (kopf runs them in a thread pool); a per-InferenceService lock keeps
the parent handler and child handlers from applying interleaved, stale intents.
"""

from __future__ import annotations

import copy
import datetime
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from phasesplit.operator import api, reconcile, render
from phasesplit.operator.metrics import autoscale
from phasesplit.operator.reconcile import Kube
from phasesplit.operator.render import Owner
from phasesplit.operator.status import deployment_summary

RESOURCE = (api.GROUP, api.VERSION, api.PLURAL)
CHILD_FILTER = {render.MANAGED_BY_LABEL: render.MANAGED_BY}
# (group, version, plural, kind) of every watched child kind; "" is the core group.
CHILD_RESOURCES = [
    ("apps", "v1", "deployments", "Deployment"),
    ("", "v1", "services", "Service"),
    ("", "v1", "serviceaccounts", "ServiceAccount"),
    ("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    ("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    ("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    ("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler"),
]

_kube: dict[str, Kube] = {}
# The status this process last wrote, per (namespace, name, uid). The index's copy lags behind our
# own writes (it is updated by the watch), and a stale copy would put back an older
# observedGeneration or reset condition transition times.
_written: dict[tuple[str, str, str], dict[str, Any]] = {}
_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def kube() -> Kube:
    return _kube["client"]


def _lock(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks[(namespace, name)]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _emitter(parent: Mapping[str, Any]):
    ref = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": dict(parent["metadata"])}

    def emit(kind: str, reason: str, message: str) -> None:
        kopf.event(ref, type=kind, reason=reason, message=message)
    return emit


def _replicas(spec: api.InferenceServiceSpec, status: Mapping[str, Any] | None,
              generation: int | None, owner: Owner | None = None) -> dict[str, int | None]:
    """Replicas to apply now. The planner's decision is read from the status this process last
    wrote when there is one: the watched copy lags, and applying an older decision would undo
    the planner's latest scaling until the next event."""
    if owner is not None:
        status = _written.get((owner.namespace, owner.name, owner.uid)) or status
    decision = ((status or {}).get("autoscaling") or {}).get("lastDecision")
    parsed = api.Decision.model_validate(decision) if decision else None
    return render.desired_replicas(spec, parsed, generation)


def _write_status(owner: Owner, spec: api.InferenceServiceSpec, index: kopf.Index,
                  seen: Mapping[str, Any], generation: int | None = None, error: str | None = None) -> None:
    """Status from the Deployment index; generation None keeps the last observedGeneration."""
    key = (owner.namespace, owner.name, owner.uid)
    current = _written.get(key) or copy.deepcopy(dict(seen))
    if generation is None:
        generation = current.get("observedGeneration")
    _written[key] = reconcile.sync_status(kube(), owner, spec, _deployments(index, owner), current, _now(),
                                          generation, error)


def _deployments(index: kopf.Index, owner: Owner) -> dict[str, dict[str, int]]:
    found = {}
    for entry in index.get((owner.namespace, owner.name), []):
        if entry["ownerUid"] == owner.uid:
            found[entry["component"]] = entry["summary"]
    return found


# ---------------------------------------------------------------------------------------------
# startup


def settings(namespaced: bool) -> kopf.OperatorSettings:
    """kopf settings for this operator (passed to kopf.operator by the CLI)."""
    out = kopf.OperatorSettings()
    # kopf's own bookkeeping goes into annotations under our group; the status stays ours.
    out.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    out.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration")
    out.persistence.finalizer = f"{api.GROUP}/finalizer"
    # Our Events are explicit (Created/Updated/...); kopf's per-handler chatter stays in the log.
    out.posting.level = logging.WARNING
    out.peering.standalone = True
    out.watching.server_timeout = 300
    out.watching.client_timeout = 330
    # Watching given namespaces needs no cluster-wide namespace/CRD scans (nor their permissions).
    out.scanning.disabled = namespaced
    return out


@kopf.on.startup()
def connect(**_: Any) -> None:
    _kube["client"] = Kube(reconcile.api_client())


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_via_client(**kwargs)


# ---------------------------------------------------------------------------------------------
# indexes


@kopf.index(*RESOURCE)
def services_by_name(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    return {(namespace, name): {
        "metadata": {"name": name, "namespace": namespace, "uid": body["metadata"]["uid"],
                     "generation": body["metadata"].get("generation")},
        "spec": copy.deepcopy(dict(body.get("spec") or {})),
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }}


@kopf.index("apps", "v1", "deployments", labels=CHILD_FILTER)
def deployments_by_owner(namespace: str, body: kopf.Body, labels: kopf.Labels,
                         **_: Any) -> dict[tuple[str, str], Any] | None:
    refs = [r for r in body["metadata"].get("ownerReferences", []) if r.get("kind") == api.KIND]
    if not refs or render.INSTANCE_LABEL not in labels:
        return None
    return {(namespace, labels[render.INSTANCE_LABEL]): {
        "component": labels.get(render.COMPONENT_LABEL), "ownerUid": refs[0]["uid"],
        "summary": deployment_summary(body),
    }}


# ---------------------------------------------------------------------------------------------
# the InferenceService itself


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
def reconcile_service(memo: kopf.Memo, namespace: str, name: str, **kwargs: Any) -> None:
    with memo.telemetry.reconciling(namespace, name):
        _reconcile_service(memo=memo, namespace=namespace, name=name, **kwargs)


def _reconcile_service(body: kopf.Body, meta: kopf.Meta, namespace: str, name: str, uid: str,
                       logger: logging.Logger, deployments_by_owner: kopf.Index, memo: kopf.Memo,
                       **_: Any) -> None:
    owner = Owner(name=name, namespace=namespace, uid=uid)
    current = copy.deepcopy(dict(body.get("status") or {}))
    emit = _emitter(body)
    with _lock(namespace, name):
        try:
            spec = api.InferenceServiceSpec.model_validate(copy.deepcopy(dict(body["spec"])))
        except ValidationError as e:
            # The CRD's schema rejects what pydantic rejects; reaching here means a rule drifted.
            emit("Warning", "InvalidSpec", str(e)[:1000])
            raise kopf.PermanentError(f"invalid spec: {e}") from e
        memo.telemetry.observe_service(namespace, name, spec)
        replicas = _replicas(spec, current, meta.get("generation"), owner)
        try:
            reconcile.sync_children(kube(), owner, spec, replicas, emit)
        except ApiException as e:
            reason = f"{e.status} {e.reason}: {reconcile._message(e)}"
            _write_status(owner, spec, deployments_by_owner, current, error=reason)
            raise kopf.TemporaryError(f"apply failed: {reason}", delay=5) from e
        _write_status(owner, spec, deployments_by_owner, current, generation=meta.get("generation"))
        logger.info("reconciled generation %s", meta.get("generation"))


@kopf.on.delete(*RESOURCE, optional=True)
def service_deleted(namespace: str, name: str, uid: str, logger: logging.Logger, memo: kopf.Memo,
                    **_: Any) -> None:
    memo.telemetry.forget(namespace, name)
    _written.pop((namespace, name, uid), None)
    _autoscalers.pop(uid, None)
    # No finalizer: owner references let the garbage collector remove every child.
    logger.info("InferenceService %s deleted; its children go with it (owner references)", name)


# ---------------------------------------------------------------------------------------------
# children


def on_child_event(event: Mapping[str, Any], body: kopf.Body, resource: kopf.Resource, namespace: str,
                   name: str, labels: kopf.Labels, logger: logging.Logger, services_by_name: kopf.Index,
                   deployments_by_owner: kopf.Index, **_: Any) -> None:
    instance = labels.get(render.INSTANCE_LABEL)
    refs = [r for r in body["metadata"].get("ownerReferences", []) if r.get("kind") == api.KIND]
    if not instance or not refs:
        return
    parents = list(services_by_name.get((namespace, instance), []))
    if not parents or parents[0]["metadata"]["uid"] != refs[0]["uid"]:
        return  # an orphan of an earlier incarnation: the garbage collector takes it
    kind = resource.kind
    deleted = event.get("type") == "DELETED"
    with _lock(namespace, instance):
        parent = parents[0]
        if deleted:
            # The owner may be on its way out (children are deleted after it): ask, don't guess.
            fresh = kube().get_service(namespace, instance)
            if not fresh or fresh["metadata"].get("deletionTimestamp") or fresh["metadata"]["uid"] != refs[0]["uid"]:
                return
            parent = fresh
        try:
            spec = api.InferenceServiceSpec.model_validate(copy.deepcopy(parent["spec"]))
        except ValidationError:
            return  # the parent handler reports it
        owner = Owner(name=instance, namespace=namespace, uid=refs[0]["uid"])
        status_now = parent.get("status") or {}
        replicas = _replicas(spec, status_now, parent["metadata"].get("generation"), owner)
        seen = None if deleted else body
        outcome = reconcile.sync_child(kube(), owner, spec, replicas, kind, name, seen, _emitter(parent))
        if outcome != "unchanged":
            logger.info("%s %s: %s", kind, name, outcome)
        if kind == "Deployment":
            _write_status(owner, spec, deployments_by_owner, status_now)


# ---------------------------------------------------------------------------------------------
# autoscaling (Planner mode)

_autoscalers: dict[str, autoscale.ServiceAutoscaler] = {}
# The timer ticks often and each service decides when its own interval has passed, so a spec's
# interval (1s and up) is honoured without re-registering timers.
AUTOSCALE_TICK_S = 1.0


def _endpoint_slices(owner: Owner) -> list[dict[str, Any]]:
    """EndpointSlices of the router and phase Services (the pods metrics source's targets)."""
    from kubernetes import client

    discovery = client.DiscoveryV1Api(kube().custom.api_client)
    out = []
    for component in ("router", *api.PHASES):
        found = discovery.list_namespaced_endpoint_slice(
            owner.namespace, label_selector=f"kubernetes.io/service-name={owner.child(component)}").items
        out += [discovery.api_client.sanitize_for_serialization(s) for s in found]
    return out


@kopf.timer(*RESOURCE, interval=AUTOSCALE_TICK_S, initial_delay=AUTOSCALE_TICK_S)
def autoscale_service(body: kopf.Body, meta: kopf.Meta, namespace: str, name: str, uid: str,
                      logger: logging.Logger, deployments_by_owner: kopf.Index, memo: kopf.Memo,
                      **_: Any) -> None:
    try:
        spec = api.InferenceServiceSpec.model_validate(copy.deepcopy(dict(body["spec"])))
    except ValidationError:
        return  # the parent handler reports it
    if spec.autoscaling.mode != "Planner":
        _autoscalers.pop(uid, None)
        return
    scaler = _autoscalers.get(uid)
    if scaler is None:
        scaler = _autoscalers[uid] = autoscale.ServiceAutoscaler(spec)
    scaler.configure(spec)
    now = time.time()
    if not scaler.due(now):
        return
    owner = Owner(name=name, namespace=namespace, uid=uid)
    deployments = _deployments(deployments_by_owner, owner)
    if any(p not in deployments for p in api.PHASES):
        return  # not reconciled yet
    current = {p: deployments[p]["desired"] for p in api.PHASES}
    slices: list[dict[str, Any]] = []
    if spec.autoscaling.metrics.source == "pods":
        try:
            slices = _endpoint_slices(owner)
        except ApiException as e:
            logger.warning("listing EndpointSlices failed: %s", reconcile._message(e))
    result = scaler.step(current, slices, now)  # metrics I/O happens outside the lock
    memo.telemetry.decided(namespace, name, spec.model.name, result.decision, result.snapshot)
    for err in result.errors:
        logger.info("metrics: %s", err)
    emit = _emitter(body)
    key = (namespace, name, uid)
    with _lock(namespace, name):
        seen = _written.get(key) or copy.deepcopy(dict(body.get("status") or {}))
        before = seen.get("autoscaling") or {}
        patch = autoscale.status_patch(result.decision, result.snapshot, now, meta.get("generation"), before)
        if patch != before:
            kube().patch_status(namespace, name, {"autoscaling": patch})
            _written[key] = {**seen, "autoscaling": patch}
        was_stale = any(c.get("type") == "MetricsAvailable" and c.get("status") == "False"
                        for c in before.get("conditions") or [])
        if result.decision.stale and not was_stale:
            emit("Warning", "MetricsStale", result.decision.prefill.reason)
        if result.decision.changed:
            replicas = _replicas(spec, _written.get(key), meta.get("generation"), owner)
            try:
                reconcile.sync_children(kube(), owner, spec, replicas, emit)
            except ApiException as e:
                logger.warning("applying the planner's decision failed: %s", reconcile._message(e))
                return
            emit("Normal", "Scaled", result.decision.reason[:1000])
            logger.info("autoscaled: %s", result.decision.reason)


def _register_children() -> None:
    for group, version, plural, _kind in CHILD_RESOURCES:
        resource = (group, version, plural) if group else (version, plural)
        kopf.on.event(*resource, labels=CHILD_FILTER)(on_child_event)


_register_children()
