"""The I/O edge: server-side apply of rendered children, pruning, and status writes.

Everything here is level-based. Children have fixed names and are applied with one field manager
and force, so applying twice is applying once, a restarted operator converges without duplicates,
and a hand edit of a field we manage is taken back on the next apply. Fields we never send (the
replicas of an HPA-managed Deployment, a Service's clusterIP) stay with whoever set them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from phasesplit.operator import api, render, status
from phasesplit.operator.render import Owner

FIELD_MANAGER = "phasesplit-operator"

# Every kind the operator may create, so pruning can find children the spec no longer wants.
CHILD_KINDS: dict[str, str] = {
    "ServiceAccount": "v1",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
}

# emit(type, reason, message): posts a Kubernetes Event on the InferenceService.
Emit = Callable[[str, str, str], None]

log = logging.getLogger(__name__)

# Worth trying again at once: a create race (409), throttling (429), a busy or restarting server.
TRANSIENT = frozenset({409, 429, 500, 502, 503, 504})
T = TypeVar("T")


def retrying(call: Callable[[], T], attempts: int = 4, first_delay: float = 0.2,
             sleep: Callable[[float], None] = time.sleep) -> T:
    """Run call, retrying transient API errors with exponential backoff; others raise at once."""
    for attempt in range(attempts):
        try:
            return call()
        except ApiException as e:
            if e.status not in TRANSIENT or attempt == attempts - 1:
                raise
            sleep(first_delay * 2**attempt)
    raise AssertionError("unreachable")


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    cfg = client.Configuration()
    try:
        if kubeconfig:
            raise config.ConfigException("explicit kubeconfig")
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


def _fingerprint(obj: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """What changes when someone edits an object, but not when a controller updates its status.

    The generation moves only with the spec (objects that have one); labels and owner references
    are ours too. Without a generation (Services, RBAC objects) the resourceVersion stands in:
    no controller writes to those.
    """
    meta = (obj or {}).get("metadata", {})
    return (meta.get("generation") or meta.get("resourceVersion"), meta.get("labels"), meta.get("ownerReferences"))


def _controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


class Kube:
    """The operator's few verbs against the API server."""

    def __init__(self, api: client.ApiClient):
        self.dynamic = DynamicClient(api)
        self.custom = client.CustomObjectsApi(api)
        self._resources: dict[str, Any] = {}

    def _resource(self, kind: str) -> Any:
        if kind not in self._resources:
            self._resources[kind] = self.dynamic.resources.get(api_version=CHILD_KINDS[kind], kind=kind)
        return self._resources[kind]

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        res = self._resource(obj["kind"])
        out = retrying(lambda: self.dynamic.server_side_apply(
            res, body=dict(obj), namespace=obj["metadata"]["namespace"], field_manager=FIELD_MANAGER,
            force_conflicts=True))
        return out.to_dict()

    def list_children(self, owner: Owner) -> dict[tuple[str, str], dict[str, Any]]:
        """Children of this owner (by label, then by controller reference uid), all kinds."""
        found = {}
        for kind in CHILD_KINDS:
            items = self.dynamic.get(self._resource(kind), namespace=owner.namespace,
                                     label_selector=render.children_selector(owner)).to_dict()["items"]
            for item in items:
                if _controlled_by(item, owner.uid):
                    found[(kind, item["metadata"]["name"])] = item
        return found

    def get_child(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.dynamic.get(self._resource(kind), name=name, namespace=namespace).to_dict()
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self.dynamic.delete(self._resource(kind), name=name, namespace=namespace,
                                propagation_policy="Background")
        except ApiException as e:
            if e.status != 404:
                raise

    def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_status(self, namespace: str, name: str, new_status: Mapping[str, Any]) -> None:
        retrying(lambda: self.custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"status": dict(new_status)},
            _content_type="application/merge-patch+json"))


def _describe(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']} {obj['metadata']['name']}"


def sync_children(kube: Kube, owner: Owner, spec: api.InferenceServiceSpec,
                  replicas: Mapping[str, int | None], emit: Emit) -> list[dict[str, Any]]:
    """Apply every wanted child and delete the unwanted ones; Events say what changed.

    One child the API server refuses does not hold back the others: every child is tried, then
    the first failure is raised (after a Warning Event each) for the caller to retry.
    """
    desired = render.render(owner, spec, replicas)
    existing = kube.list_children(owner)
    applied = []
    failures: list[ApiException] = []
    for obj in desired:
        before = existing.get(render.key(obj))
        try:
            after = kube.apply(obj)
        except ApiException as e:
            emit("Warning", "ApplyFailed", f"{_describe(obj)}: {e.reason}: {_message(e)}")
            failures.append(e)
            continue
        applied.append(after)
        if before is None:
            emit("Normal", "Created", f"created {_describe(obj)}")
        elif _fingerprint(before) != _fingerprint(after):
            emit("Normal", "Updated", f"updated {_describe(obj)}")
    wanted = {render.key(o) for o in desired}
    for (kind, name) in sorted(set(existing) - wanted):
        try:
            kube.delete(kind, owner.namespace, name)
        except ApiException as e:
            emit("Warning", "DeleteFailed", f"{kind} {name}: {e.reason}: {_message(e)}")
            raise
        emit("Normal", "Deleted", f"deleted {kind} {name} (no longer wanted by the spec)")
    if failures:
        raise failures[0]
    return applied


def sync_child(kube: Kube, owner: Owner, spec: api.InferenceServiceSpec, replicas: Mapping[str, int | None],
               kind: str, name: str, seen: Mapping[str, Any] | None, emit: Emit) -> str:
    """Bring one child back to what the spec wants after a watch event on it.

    seen: the child as the event showed it (None when it was deleted). Returns what happened:
    "unchanged", "reverted", "recreated", "deleted" or "ignored".
    """
    desired = {render.key(o): o for o in render.render(owner, spec, replicas)}
    obj = desired.get((kind, name))
    if obj is None:
        if seen is None:
            return "ignored"
        kube.delete(kind, owner.namespace, name)
        emit("Normal", "Deleted", f"deleted {kind} {name} (no longer wanted by the spec)")
        return "deleted"
    after = kube.apply(obj)
    if seen is None:
        emit("Normal", "Recreated", f"recreated {_describe(obj)} after it was deleted")
        return "recreated"
    if _fingerprint(after) != _fingerprint(seen):
        emit("Normal", "Reverted", f"reverted a change to {_describe(obj)} that the spec does not want")
        return "reverted"
    return "unchanged"


def sync_status(kube: Kube, owner: Owner, spec: api.InferenceServiceSpec,
                deployments: Mapping[str, Mapping[str, int]], current: Mapping[str, Any] | None,
                now: str, observed_generation: int | None, error: str | None = None) -> dict[str, Any]:
    """Write the computed status if it differs from `current`; returns the status now in place."""
    new = status.compute_status(owner, spec, deployments, current, now, observed_generation, error)
    if not status.same_status(current, new):
        kube.patch_status(owner.namespace, owner.name, new)
    return {**(current or {}), **new}


def _message(e: ApiException) -> str:
    """The API server's own message from an error response, which names the offending field."""
    import json

    try:
        return json.loads(e.body).get("message", "") if e.body else ""
    except (ValueError, AttributeError):
        return str(e.body)[:500]
