"""One reconcile pass of an InferenceService, kubebuilder-style: desired state from render, observed
state from the watch cache, apply only the children that differ, prune, write status once.

The comparison is pure (`differs`, `plan_children`), so it is tested without a cluster; the pass
itself (`reconcile_children`) goes through the `Kube` verbs it is given.

A child needs an apply when it is missing, when our intent changed (the hash of the rendered
object, kept in an annotation, differs: this also catches fields we stopped sending), or when
someone else changed a field we set (the live object no longer contains the rendered one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException

from phasesplit.operator import api, render, status
from phasesplit.operator.kube import api_message
from phasesplit.operator.render import Owner

INTENT_ANNOTATION = f"{api.GROUP}/intent"

# emit(type, reason, message): posts a Kubernetes Event on the InferenceService.
Emit = Callable[[str, str, str], None]
Key = tuple[str, str]  # (kind, name)

log = logging.getLogger(__name__)


class Verbs(Protocol):
    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...
    def delete(self, kind: str, namespace: str, name: str) -> None: ...
    def patch_status(self, namespace: str, name: str, new_status: Mapping[str, Any]) -> None: ...
    def create_if_absent(self, obj: Mapping[str, Any]) -> bool: ...


def intent(obj: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def stamped(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The rendered object with the hash of itself in an annotation (one stamped already, as the
    controller keeps them between passes, as it is)."""
    if INTENT_ANNOTATION in (obj["metadata"].get("annotations") or {}):
        return dict(obj)
    meta = dict(obj["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), INTENT_ANNOTATION: intent(obj)}
    return {**obj, "metadata": meta}


def _zero(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == "" or value == [] or value == {}


def contains(have: Any, want: Any) -> bool:
    """Whether the live value holds every field of the wanted one (the server adds defaults; a
    quantity may come back as a string; a zero value may be left out, as Go's omitempty does)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(contains(have[k], v) if k in have else _zero(v)
                                              for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(map(contains, have, want))
    if want == have:
        return True
    loose = (int, float, str)
    return type(want) in loose and type(have) in loose and str(want) == str(have)


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


@dataclass
class ChildPlan:
    """What one pass must do: each entry says why, for the Event."""

    apply: list[tuple[dict[str, Any], str]] = field(default_factory=list)  # (object, Created|Recreated|Updated|Reverted)
    delete: list[Key] = field(default_factory=list)


def plan_children(desired: list[dict[str, Any]], observed: Mapping[Key, Mapping[str, Any]],
                  known: set[Key] | frozenset[Key] = frozenset()) -> ChildPlan:
    """Pure: the applies and deletes that bring `observed` to `desired` (stamped objects).

    known: children this process saw before (a missing one was deleted: Recreated, not Created).
    """
    out = ChildPlan()
    for obj in desired:
        key = render.key(obj)
        have = observed.get(key)
        if have is None:
            out.apply.append((obj, "Recreated" if key in known else "Created"))
        elif (have["metadata"].get("annotations") or {}).get(INTENT_ANNOTATION) != \
                obj["metadata"]["annotations"][INTENT_ANNOTATION]:
            out.apply.append((obj, "Updated"))
        elif not contains(have, obj):
            out.apply.append((obj, "Reverted"))
    wanted = {render.key(o) for o in desired}
    out.delete = sorted(set(observed) - wanted)
    return out


_EVENT_TEXT = {"Created": "created {}", "Recreated": "recreated {} after it was deleted",
               "Updated": "updated {}", "Reverted": "reverted a change to {} that the spec does not want",
               "Deleted": "deleted {} (no longer wanted by the spec)"}


def _announce(emit: Emit, done: dict[str, list[str]]) -> None:
    """One Normal Event per reason and pass, naming every child it concerns (a new service is one
    `Created` Event, not fourteen)."""
    for reason, what in done.items():
        emit("Normal", reason, _EVENT_TEXT[reason].format(", ".join(what)))


def ensure_internal_secret(kube: Verbs, owner: Owner, done: dict[str, list[str]]) -> None:
    """Create the service's internal secret, a random value made here, if it does not exist.

    Created once and never applied again (an apply would replace the value and split the pods
    that started with the old one); not a child kind (not watched or pruned: the owner reference
    removes it with the service), and the operator may create Secrets but not read them. The
    value is never logged. Called when a Deployment is created or recreated (so a Secret deleted
    by hand comes back with the next Deployment that does; routine passes make no extra call).
    """
    obj = render.internal_secret(owner, secrets.token_urlsafe(32))
    if kube.create_if_absent(obj):
        done.setdefault("Created", []).append(f"Secret {obj['metadata']['name']}")


def reconcile_children(kube: Verbs, owner: Owner, desired: list[dict[str, Any]],
                       observed: Mapping[Key, Mapping[str, Any]], emit: Emit,
                       known: set[Key] | frozenset[Key] = frozenset()) -> tuple[dict[Key, dict[str, Any]], list[Key]]:
    """Apply the children that differ and delete the unwanted ones; Events say what changed.

    observed: this owner's children as the watch last showed them. Returns the objects the API
    server answered with (for the cache) and the deleted keys. One child the API server refuses
    does not hold back the others: every child is tried, then the first failure is raised (after
    a Warning Event each) for the caller to retry.
    """
    stamped_desired = [stamped(o) for o in desired]
    plan = plan_children(stamped_desired, observed, known)
    applied: dict[Key, dict[str, Any]] = {}
    failures: list[ApiException] = []
    done: dict[str, list[str]] = {}
    if any(o["kind"] == "Deployment" and why in ("Created", "Recreated") for o, why in plan.apply):
        ensure_internal_secret(kube, owner, done)  # before the pods that mount it (one call, then none)
    for obj, why in plan.apply:
        what = f"{obj['kind']} {obj['metadata']['name']}"
        try:
            applied[render.key(obj)] = kube.apply(obj)
        except ApiException as e:
            emit("Warning", "ApplyFailed", f"{what}: {e.reason}: {api_message(e)}")
            failures.append(e)
            continue
        done.setdefault(why, []).append(what)
    for kind, name in plan.delete:
        try:
            kube.delete(kind, owner.namespace, name)
        except ApiException as e:
            _announce(emit, done)
            emit("Warning", "DeleteFailed", f"{kind} {name}: {e.reason}: {api_message(e)}")
            raise
        done.setdefault("Deleted", []).append(f"{kind} {name}")
    _announce(emit, done)
    if failures:
        raise failures[0]
    return applied, plan.delete


def write_status(kube: Verbs, owner: Owner, new: Mapping[str, Any], current: Mapping[str, Any] | None) -> dict[str, Any]:
    """The one status write of a pass, only if something changed; returns the status now in place."""
    if not status.same_status(current, new):
        kube.patch_status(owner.namespace, owner.name, new)
    return {**(current or {}), **new}
