"""Leader election with a coordination.k8s.io Lease, as client-go's leaderelection does it.

Every operator replica watches and keeps its caches warm; only the holder of the Lease writes.
The holder renews the Lease every `retry_s`; a candidate takes it over once it has not been
renewed for `lease_s`. Writes go through the resourceVersion (optimistic concurrency), so two
candidates racing for an expired Lease cannot both win. A holder that cannot renew within
`renew_deadline_s` stops acting before anyone else may take over (renew_deadline < lease).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)


class LeaseVerbs(Protocol):
    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]: ...


def _micro(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class LeaderElector:
    def __init__(self, kube: LeaseVerbs, namespace: str, name: str, identity: str,
                 on_change: Callable[[bool], None], lease_s: float = 15.0, renew_deadline_s: float = 10.0,
                 retry_s: float = 2.0, clock: Callable[[], float] = time.time):
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.on_change = on_change
        self.lease_s, self.renew_deadline_s, self.retry_s, self.clock = lease_s, renew_deadline_s, retry_s, clock
        self.leading = False
        self._last_renew = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def try_once(self) -> bool:
        """One acquire-or-renew round; returns whether we hold the Lease now."""
        now = self.clock()
        try:
            lease = self.kube.get_lease(self.namespace, self.name)
            spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_s),
                    "renewTime": _micro(now)}
            if lease is None:
                spec["acquireTime"] = _micro(now)
                self.kube.create_lease(self.namespace, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec})
            else:
                held = lease.get("spec") or {}
                holder = held.get("holderIdentity")
                renewed = _parse(held.get("renewTime")) or 0.0
                duration = held.get("leaseDurationSeconds") or self.lease_s
                if holder and holder != self.identity and now - renewed < duration:
                    return self._set(False)
                if holder != self.identity:
                    spec["acquireTime"] = _micro(now)
                    spec["leaseTransitions"] = int(held.get("leaseTransitions") or 0) + 1
                else:
                    spec["acquireTime"] = held.get("acquireTime") or _micro(now)
                    spec["leaseTransitions"] = int(held.get("leaseTransitions") or 0)
                self.kube.replace_lease(self.namespace, self.name, {**lease, "spec": spec})
        except Exception as e:  # noqa: BLE001 - any failure (a lost race: 409) is "not renewed"
            if isinstance(e, ApiException) and e.status == 409:
                log.debug("leader election: another candidate wrote the Lease first")
            else:
                log.warning("leader election: %s", e)
            if self.leading and now - self._last_renew > self.renew_deadline_s:
                return self._set(False)
            return self.leading
        self._last_renew = now
        return self._set(True)

    def _set(self, leading: bool) -> bool:
        if leading != self.leading:
            self.leading = leading
            log.info("%s the Lease %s/%s (%s)", "acquired" if leading else "lost", self.namespace, self.name,
                     self.identity)
            self.on_change(leading)
        return leading

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self.leading:
            self._release()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.try_once()
            self._stop.wait(self.retry_s)

    def _release(self) -> None:
        """Hand the Lease over at once on a clean stop (a successor need not wait for it to expire)."""
        try:
            lease = self.kube.get_lease(self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {**lease["spec"], "holderIdentity": None, "renewTime": None}
                self.kube.replace_lease(self.namespace, self.name, {**lease, "spec": spec})
        except Exception as e:  # noqa: BLE001 - the Lease expires by itself anyway
            log.warning("releasing the Lease: %s", e)
        self._set(False)
