"""kopf wiring only: which watch events reach the controller. Logic lives in controller.py.

kopf watches (with reconnects, login and the liveness endpoint); every handler here hands the
event to the Controller kept in kopf's memo, which updates its caches and enqueues the parent
InferenceService. The handlers are coroutines that never wait (a short lock at most): a sync
handler would cost a hop through kopf's thread pool for each of the many watch events. Only `on.event` handlers are used: they need no finalizer and write nothing
to the watched objects, so deleting an InferenceService (or its namespace) never waits for the
operator.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from phasesplit.operator import api, render
from phasesplit.operator.controller import ENDPOINT_SLICES, PODS, Controller

CHILD_FILTER = {render.MANAGED_BY_LABEL: render.MANAGED_BY}


def _resource(kind: render.ChildKind) -> tuple[str, ...]:
    return (kind.group, kind.version, kind.plural) if kind.group else (kind.version, kind.plural)


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf builds a diff base (a deep copy of the object's essence) on every event, for change
    handlers; this operator has none, so there is nothing to build, keep or compare."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        pass


def settings(namespaced: bool) -> kopf.OperatorSettings:
    """kopf settings for this operator (passed to kopf.operator by the CLI)."""
    out = kopf.OperatorSettings()
    out.posting.level = logging.WARNING  # our Events are explicit (Created/Updated/...)
    out.peering.standalone = True  # one actor at a time is the controller's Lease, not kopf peering
    out.watching.server_timeout = 300
    out.watching.client_timeout = 330
    out.watching.connect_timeout = 10
    out.networking.request_timeout = 30
    out.networking.connect_timeout = 10
    out.persistence.diffbase_storage = NoDiffBase()
    # Watching given namespaces needs no cluster-wide namespace/CRD scans (nor their permissions).
    out.scanning.disabled = namespaced
    # Children and their EndpointSlices filtered by the API server: the operator never receives
    # the cluster's other Deployments, Services, ...
    selector = ",".join(f"{k}={v}" for k, v in CHILD_FILTER.items())
    for kind in (*render.CHILD_KINDS, ENDPOINT_SLICES, PODS):
        out.watching.label_selectors[_resource(kind)] = selector
    return out


def registry() -> kopf.OperatorRegistry:
    """The handlers, registered into a fresh registry (nothing happens at import)."""
    reg = kopf.OperatorRegistry()

    @kopf.on.login(registry=reg)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=reg)
    def start(memo: kopf.Memo, **_: Any) -> None:
        memo.controller.start()

    @kopf.on.cleanup(registry=reg)
    def stop(memo: kopf.Memo, **_: Any) -> None:
        memo.controller.stop()

    @kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, registry=reg)
    async def parent(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
        memo.controller.observe_parent(event.get("type"), event["object"])

    async def child(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
        memo.controller.observe_child(event.get("type"), event["object"])

    for kind in render.CHILD_KINDS:
        kopf.on.event(*_resource(kind), labels=CHILD_FILTER, registry=reg, id=f"child-{kind.plural}")(child)

    # EndpointSlices carry their Service's labels: the planner's scrape targets.
    @kopf.on.event(*_resource(ENDPOINT_SLICES), labels=CHILD_FILTER, registry=reg)
    async def endpoint_slice(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
        memo.controller.observe_slice(event.get("type"), event["object"])

    # The services' pods: their start-up (creation to Ready) is what the planner reacts with.
    @kopf.on.event(*_resource(PODS), labels=CHILD_FILTER, registry=reg)
    async def pod(event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
        memo.controller.observe_pod(event.get("type"), event["object"])

    return reg


def memo(controller: Controller) -> kopf.Memo:
    return kopf.Memo(controller=controller)
