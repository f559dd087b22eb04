"""The I/O edge: the operator's few verbs against the API server, each with a timeout.

Children are applied with server-side apply under one field manager with force, so applying
twice is applying once, a restarted operator converges without duplicates, and a hand edit of a
field we manage is taken back by the next apply. Fields we never send (the replicas of an
HPA-managed Deployment, a Service's clusterIP) stay with whoever set them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from phasesplit.operator import api, render
from phasesplit.operator.render import ChildKind, Owner
from phasesplit.runtime.units import rfc3339

FIELD_MANAGER = "phasesplit-operator"
# (connect, read) seconds for every call: a hung API server must not hold a worker forever.
REQUEST_TIMEOUT = (5.0, 30.0)
# Lease calls must give up well inside the leader's renew deadline (10 s; the Lease lasts 15 s):
# with the 30 s read timeout a holder stuck in a renew against a hung API server could not step
# down before another candidate took the expired Lease.
LEASE_TIMEOUT = (2.0, 4.0)
# Worth trying again at once: a create race (409), throttling (429), a busy or restarting server.
TRANSIENT = frozenset({409, 429, 500, 502, 503, 504})
KINDS = {k.kind: k for k in render.CHILD_KINDS}
PARENT = ChildKind(api.API_VERSION, api.PLURAL, api.KIND)

log = logging.getLogger(__name__)
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


def api_message(e: ApiException) -> str:
    """The API server's own message from an error response, which names the offending field."""
    try:
        return json.loads(e.body).get("message", "") if e.body else ""
    except (ValueError, AttributeError):
        return str(e.body)[:500]


def namespace_terminating(e: BaseException) -> bool:
    """The API server refused a create because the namespace is being deleted: nothing to retry."""
    return isinstance(e, ApiException) and e.status == 403 and "being terminated" in api_message(e)


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    cfg = client.Configuration()
    try:
        if kubeconfig:
            raise config.ConfigException("explicit kubeconfig")
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    # A connection per worker thread and the resync (urllib3's pool is shared by the threads).
    cfg.connection_pool_maxsize = 32
    return client.ApiClient(cfg)


def _path(kind: ChildKind, namespace: str | None, name: str | None = None) -> str:
    base = "/api/v1" if kind.api_version == "v1" else f"/apis/{kind.api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{kind.plural}" + (f"/{name}" if name else "")


class Kube:
    """Plain REST calls through the client's ApiClient: JSON in, dicts out (no model classes)."""

    def __init__(self, api_client: client.ApiClient):
        self.api = api_client

    def _call(self, method: str, path: str, body: Any = None, query: Sequence[tuple[str, Any]] = (),
              content_type: str = "application/json",
              timeout: tuple[float, float] = REQUEST_TIMEOUT) -> dict[str, Any]:
        method, url, headers, body, post = self.api.param_serialize(
            method=method, resource_path=path, query_params=list(query), body=body,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            auth_settings=["BearerToken"])
        resp = self.api.call_api(method, url, header_params=headers, body=body, post_params=post,
                                 _request_timeout=timeout)
        data = resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException(status=resp.status, reason=resp.reason, body=data.decode(errors="replace"))
        return json.loads(data) if data else {}

    # children

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = _path(KINDS[obj["kind"]], meta["namespace"], meta["name"])
        return retrying(lambda: self._call(
            "PATCH", path, body=json.dumps(obj), content_type="application/apply-patch+yaml",
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")]))

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            retrying(lambda: self._call("DELETE", _path(KINDS[kind], namespace, name),
                                        body={"propagationPolicy": "Background"}))
        except ApiException as e:
            if e.status != 404:
                raise

    def create_if_absent(self, obj: Mapping[str, Any]) -> bool:
        """POST a core/v1 object (the internal Secret); False when one of its name exists."""
        meta = obj["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/{obj['kind'].lower()}s"

        def create() -> bool:
            try:
                self._call("POST", path, body=dict(obj))
                return True
            except ApiException as e:
                if e.status == 409:  # exists: keep its value (not a transient conflict to retry)
                    return False
                raise
        return retrying(create)

    def list(self, kind: ChildKind, namespace: str | None, selector: str | None = None, limit: int | None = None,
             continue_: str | None = None) -> dict[str, Any]:
        """One LIST (namespace None: the whole cluster), or one page of it (limit; continue_: the
        previous page's metadata.continue); returns the list object (items, metadata)."""
        query: list[tuple[str, Any]] = [("labelSelector", selector)] if selector else []
        if limit:
            query.append(("limit", limit))
        if continue_:
            query.append(("continue", continue_))
        return retrying(lambda: self._call("GET", _path(kind, namespace), query=query))

    # the InferenceService

    def get_parent(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", _path(PARENT, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_status(self, namespace: str, name: str, new_status: Mapping[str, Any]) -> None:
        path = _path(PARENT, namespace, name) + "/status"
        retrying(lambda: self._call("PATCH", path, body={"status": dict(new_status)},
                                    content_type="application/merge-patch+json"))

    def set_finalizers(self, namespace: str, name: str, finalizers: list[str], resource_version: str) -> None:
        """Replace the finalizer list, if the object is still at resource_version (else 409)."""
        self._call("PATCH", _path(PARENT, namespace, name), content_type="application/merge-patch+json",
                   body={"metadata": {"finalizers": finalizers, "resourceVersion": resource_version}})

    def post_event(self, owner: Owner, kind: str, reason: str, message: str) -> None:
        """A core/v1 Event on the InferenceService (best effort: an Event lost is only a log line lost)."""
        now = rfc3339(time.time())
        body = {
            "metadata": {"generateName": f"{owner.name}.", "namespace": owner.namespace},
            "involvedObject": {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": owner.name,
                               "namespace": owner.namespace, "uid": owner.uid},
            "type": kind, "reason": reason, "message": message[:1024],
            "source": {"component": FIELD_MANAGER}, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self._call("POST", f"/api/v1/namespaces/{owner.namespace}/events", body=body)
        except (ApiException, OSError) as e:
            if not namespace_terminating(e):
                log.warning("could not post Event %s %s on %s/%s: %s", kind, reason, owner.namespace, owner.name, e)

    # leases (leader election)

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}",
                              timeout=LEASE_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create_lease(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._call("POST", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases", body=dict(body),
                          timeout=LEASE_TIMEOUT)

    def replace_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT with the body's resourceVersion: fails with 409 if another holder wrote first."""
        return self._call("PUT", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}",
                          body=dict(body), timeout=LEASE_TIMEOUT)
