"""The operator's state and its loops: one object owns everything that changes while it runs.

- Watch events (delivered by kopf, see handlers.py) update the caches and enqueue the parent
  InferenceService; nothing else triggers work. Reconcile passes run on a few worker threads
  from a de-duplicating work queue (workqueue.py), one pass per service at a time, and a failed
  pass comes back with backoff.
- A pass (`_reconcile`) reads the cached parent and children, renders, applies only the
  children that differ (reconcile.py), and writes status once.
- One planner loop steps the autoscaler of each Planner-mode service when its interval has
  passed; its decision goes to the next pass of that service in memory.
- Pod events of the services' pods give each phase's measured start-up (startup.py), which
  status shows and the planner takes as its reaction time.
- A periodic resync re-lists everything (catching what a dropped watch missed) and enqueues
  every service.
- With leader election only the Lease holder reconciles and plans; every replica keeps its
  caches warm, so a new leader starts from a full picture.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from phasesplit.operator import api, render, status
from phasesplit.operator.kube import PARENT, Kube, api_message, namespace_terminating
from phasesplit.operator.leader import LeaderElector
from phasesplit.operator.metrics.autoscale import ServiceAutoscaler, endpoint_targets, status_patch
from phasesplit.operator.reconcile import INTENT_ANNOTATION, reconcile_children, stamped, write_status
from phasesplit.operator.render import Owner, PlannedReplicas
from phasesplit.operator.startup import StartupTimes
from phasesplit.operator.telemetry import OperatorTelemetry
from phasesplit.operator.workqueue import WorkQueue
from phasesplit.runtime.units import rfc3339

log = logging.getLogger(__name__)

ServiceKey = tuple[str, str]  # (namespace, name)
ChildKey = tuple[str, str]  # (kind, name)
# The finalizer earlier versions (a kopf timer) put on every InferenceService; removed on sight.
LEGACY_FINALIZER = f"{api.GROUP}/finalizer"
# Items per LIST page in a resync (the API server's own pages: a thousand services' children are
# never all in memory as full objects at once).
LIST_PAGE = 500
ENDPOINT_SLICES = render.ChildKind("discovery.k8s.io/v1", "endpointslices", "EndpointSlice")
PODS = render.ChildKind("v1", "pods", "Pod")  # watched for start-up times only, never cached


@dataclass
class Settings:
    namespaces: list[str] = field(default_factory=list)  # empty: the whole cluster
    workers: int = 16
    resync_s: float = 300.0
    planner_tick_s: float = 1.0
    planner_concurrency: int = 32
    leader_election: bool = True
    lease_namespace: str = "default"
    lease_name: str = "phasesplit-operator"
    identity: str = "phasesplit-operator"


@dataclass
class ServiceRecord:
    """What the operator knows and remembers about one InferenceService."""

    uid: str
    meta: dict[str, Any]
    spec_body: dict[str, Any]
    status: dict[str, Any]  # as last written by us (or first seen)
    spec: api.InferenceServiceSpec | None = None
    spec_generation: int | None = None
    spec_error: str | None = None
    invalid_reported: int | None = None
    decision: PlannedReplicas | None = None
    autoscaling: dict[str, Any] | None = None  # status.autoscaling as the planner loop last described it
    autoscaler: ServiceAutoscaler | None = None
    planning: bool = False
    known: set[ChildKey] = field(default_factory=set)
    configured: api.InferenceServiceSpec | None = None  # the spec autoscaler and telemetry were set up for
    # ((generation, replicas), child -> intent hash) of the last render; the objects themselves
    # are rendered again only when a child needs comparing (a thousand services' worth of
    # rendered Deployments would be tens of MB).
    rendered: tuple[Any, dict[ChildKey, str]] | None = None
    # child -> (content_rv, intent) at which a pass found it holding what we want: later passes
    # (a Deployment's status moved, a resync) need not decompress and compare it again.
    settled: dict[ChildKey, tuple[int, str]] = field(default_factory=dict)

    @property
    def owner_uid(self) -> str:
        return self.uid

    def validated(self) -> api.InferenceServiceSpec | None:
        """The spec, validated once per generation (None, with spec_error, when invalid)."""
        generation = self.meta.get("generation")
        if self.spec_generation != generation or (self.spec is None and self.spec_error is None):
            self.spec_generation = generation
            try:
                self.spec, self.spec_error = api.InferenceServiceSpec.model_validate(self.spec_body), None
            except ValidationError as e:
                self.spec, self.spec_error = None, str(e)
        return self.spec


def _rv(obj: Mapping[str, Any]) -> int | None:
    try:
        return int(obj["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


def _newer(new: Mapping[str, Any], old: Cached | Mapping[str, Any] | None) -> bool:
    """Whether `new` may replace `old` in a cache (an event older than our own apply must not)."""
    if old is None:
        return True
    a, b = _rv(new), old.rv if isinstance(old, Cached) else _rv(old)
    return a is None or b is None or a >= b


def _shape(meta: Mapping[str, Any]) -> tuple[int, int] | None:
    """What an update that touches only an object's status leaves alone, as (generation, a hash
    of the metadata a status writer does not touch): None for kinds without metadata.generation,
    whose every update may be a change of content. A hash, not the dicts themselves: fourteen
    children's labels and annotations a service would be kept twice otherwise."""
    if meta.get("generation") is None:
        return None
    rest = [meta.get(k) for k in ("labels", "annotations", "ownerReferences", "finalizers", "deletionTimestamp")]
    return meta["generation"], hash(json.dumps(rest, sort_keys=True, separators=(",", ":")))


@dataclass(frozen=True)
class Cached:
    """A child as the cache keeps it: compressed JSON without managedFields and status (a
    thousand services' children take a few MB, not hundreds), and apart what the loops read
    often. content_rv: the resourceVersion its content (all but status) was taken at, kept
    across status-only updates, so a pass knows what it already compared."""

    rv: int | None
    content_rv: int | None
    controllers: frozenset[str]  # uids of its controller owner references
    summary: dict[str, int] | None  # a Deployment's numbers for status and the planner
    shape: tuple[int, int] | None
    blob: bytes

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Cached:
        meta = dict(obj.get("metadata") or {})
        meta.pop("managedFields", None)
        refs = meta.get("ownerReferences") or []
        rv = _rv(obj)
        content = {k: v for k, v in obj.items() if k != "status"}
        content["metadata"] = meta
        return cls(rv, rv, frozenset(r.get("uid") for r in refs if r.get("controller")),
                   status.deployment_summary(obj) if obj.get("kind") == "Deployment" else None, _shape(meta),
                   zlib.compress(json.dumps(content, separators=(",", ":")).encode(), 1))

    def updated(self, obj: Mapping[str, Any]) -> Cached | None:
        """This entry moved to obj's resourceVersion, if obj changed only its status (else None:
        build a new one)."""
        shape = _shape(obj.get("metadata") or {})
        if shape is None or shape != self.shape:
            return None
        summary = status.deployment_summary(obj) if self.summary is not None else None
        return replace(self, rv=_rv(obj), summary=summary)

    def body(self) -> dict[str, Any]:
        return json.loads(zlib.decompress(self.blob))


def _instance(body: Mapping[str, Any]) -> ServiceKey | None:
    """The InferenceService an object belongs to, by its instance label (children and their
    EndpointSlices, which carry their Service's labels)."""
    meta = body["metadata"]
    instance = (meta.get("labels") or {}).get(render.INSTANCE_LABEL)
    return (meta["namespace"], instance) if instance else None


def _hpa_zero(spec: api.InferenceServiceSpec) -> str | None:
    """Why HPA mode will not scale this spec to zero, where it asks for that (None otherwise)."""
    a = spec.autoscaling
    if a.mode != "HPA" or not (a.scale_to_zero or any(spec.phase(p).min_replicas == 0 for p in api.PHASES)):
        return None
    return ("HPA mode cannot scale to zero: a HorizontalPodAutoscaler needs the alpha HPAScaleToZero feature "
            "gate for minReplicas 0, so it is rendered as 1 and scaleToZero does nothing; use mode Planner "
            "for scale to zero (the router holds requests while the phases are at zero)")


def _seed_decision(status_body: Mapping[str, Any]) -> PlannedReplicas | None:
    last = ((status_body or {}).get("autoscaling") or {}).get("lastDecision")
    if not last:
        return None
    return PlannedReplicas(last.get("prefillReplicas"), last.get("decodeReplicas"), last.get("generation"))


class Controller:
    def __init__(self, kube: Kube, settings: Settings, telemetry: OperatorTelemetry | None = None):
        self.kube, self.settings = kube, settings
        self.telemetry = telemetry or OperatorTelemetry()
        self.queue = WorkQueue()
        self._lock = threading.Lock()
        self.records: dict[ServiceKey, ServiceRecord] = {}
        self.children: dict[ServiceKey, dict[ChildKey, Cached]] = {}
        self.slices: dict[ServiceKey, dict[str, dict[str, Any]]] = {}
        self.startups: dict[ServiceKey, StartupTimes] = {}
        self._stop = threading.Event()
        self.synced = threading.Event()  # the caches hold a full first LIST: passes may start
        self._http: httpx.AsyncClient | None = None  # the planner loop's, for every scrape
        self._threads: list[threading.Thread] = []
        self.leading = not settings.leader_election
        self.elector: LeaderElector | None = None
        if settings.leader_election:
            self.elector = LeaderElector(kube, settings.lease_namespace, settings.lease_name, settings.identity,
                                         self._leadership_changed)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for i in range(self.settings.workers):
            self._spawn(self._work, f"reconcile-{i}")
        self._spawn(self._resync_loop, "resync")
        self._spawn(lambda: asyncio.run(self._plan_loop()), "planner")
        if self.elector:
            self.elector.start()

    def stop(self) -> None:
        self._stop.set()
        self.queue.close()
        if self.elector:
            self.elector.stop()
        for t in self._threads:
            t.join(timeout=10)

    def _spawn(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _leadership_changed(self, leading: bool) -> None:
        self.leading = leading
        if leading:
            self.enqueue_all()

    def enqueue_all(self) -> None:
        with self._lock:
            keys = list(self.records)
        for key in keys:
            self.queue.add(key)

    # ------------------------------------------------------------------ watch events

    def observe_parent(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if event_type == "DELETED":
            with self._lock:
                self.records.pop(key, None)
                self.startups.pop(key, None)
            self.telemetry.forget(*key)
            return
        with self._lock:
            rec = self.records.get(key)
            fresh = rec is None or rec.uid != meta["uid"]
            if fresh:
                seen = copy.deepcopy(dict(body.get("status") or {}))
                rec = self.records[key] = ServiceRecord(
                    uid=meta["uid"], meta={}, spec_body={}, status=seen, decision=_seed_decision(seen),
                    autoscaling=seen.get("autoscaling"))
            changed = fresh or any(rec.meta.get(k) != meta.get(k)
                                   for k in ("generation", "deletionTimestamp", "finalizers"))
            rec.meta = {k: copy.deepcopy(meta.get(k)) for k in
                        ("name", "namespace", "uid", "generation", "resourceVersion", "deletionTimestamp",
                         "finalizers")}
            if changed:
                rec.spec_body = copy.deepcopy(dict(body.get("spec") or {}))
        if changed:  # status-only updates (our own writes among them) need no pass
            self.queue.add(key)

    def observe_child(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = _instance(body)
        if key is None:
            return
        child = (body["kind"], body["metadata"]["name"])
        with self._lock:
            cache = self.children.setdefault(key, {})
            if event_type == "DELETED":
                if cache.pop(child, None) is None:
                    return
            else:
                old = cache.get(child)
                if old is not None and old.rv is not None and old.rv == _rv(body):
                    return  # the echo of our own apply: already in the cache
                if not _newer(body, old):
                    return
                moved = old.updated(body) if old is not None else None
                cache[child] = moved or Cached.of(body)
                if moved is not None and moved.summary == old.summary:
                    # Only a status no pass reads changed (a PodDisruptionBudget's counts, an
                    # HPA's conditions, a Deployment's conditions): nothing to do.
                    return
            known = key in self.records
        if known:
            self.queue.add(key)

    def observe_slice(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = _instance(body)
        if key is None:
            return
        meta = body["metadata"]
        with self._lock:
            cache = self.slices.setdefault(key, {})
            if event_type == "DELETED":
                cache.pop(meta["name"], None)
            elif _newer(body, cache.get(meta["name"])):
                cache[meta["name"]] = {"metadata": {"resourceVersion": meta.get("resourceVersion")},
                                       "ports": body.get("ports"), "endpoints": body.get("endpoints")}

    def observe_pod(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A phase pod that turned Ready: its start-up joins the phase's rolling median (status
        shows it at the next pass; the planner reads it at its next step)."""
        key = _instance(body)
        meta = body["metadata"]
        phase = (meta.get("labels") or {}).get(render.COMPONENT_LABEL)
        if key is None or phase not in api.PHASES or event_type == "DELETED":
            return
        with self._lock:
            counted = self.startups.setdefault(key, StartupTimes()).observe(phase, meta.get("uid", ""), body)
            known = key in self.records
        if counted and known:
            self.queue.add(key)

    def startup_times(self, key: ServiceKey) -> dict[str, float]:
        """Each phase's measured start-up (rolling median, seconds), where one was measured."""
        with self._lock:
            times = self.startups.get(key)
            return times.medians() if times is not None else {}

    # ------------------------------------------------------------------ reconcile

    def _work(self) -> None:
        # Before the first full LIST a pass would take children not yet seen for missing.
        while not self.synced.wait(1.0):
            if self._stop.is_set():
                return
        while not self._stop.is_set():
            key = self.queue.get()
            if key is None:
                return
            try:
                if self.leading:
                    with self.telemetry.reconciling(*key):
                        self._reconcile(key)
                self.queue.forget(key)
            except Exception as e:  # noqa: BLE001 - any failure: try again later, never stop the worker
                delay = self.queue.retry(key)
                detail = f"{e.status} {e.reason}: {api_message(e)}" if isinstance(e, ApiException) else repr(e)
                log.warning("reconciling %s/%s failed (again in %.1f s): %s", *key, delay, detail)
            finally:
                self.queue.done(key)

    def _cached(self, key: ServiceKey, uid: str) -> dict[ChildKey, Cached]:
        """This owner's children (an orphan of an earlier incarnation is the collector's)."""
        with self._lock:
            return {k: v for k, v in self.children.get(key, {}).items() if uid in v.controllers}

    def _deployments(self, key: ServiceKey, owner: Owner) -> dict[str, dict[str, int]]:
        cached = self._cached(key, owner.uid)
        out = {}
        for component in api.COMPONENTS:
            found = cached.get(("Deployment", owner.child(component)))
            if found is not None and found.summary is not None:
                out[component] = found.summary
        return out

    def _remember(self, key: ServiceKey, applied: Mapping[ChildKey, dict[str, Any]], deleted: Iterable[ChildKey]) -> None:
        with self._lock:
            cache = self.children.setdefault(key, {})
            for child, obj in applied.items():
                if _newer(obj, cache.get(child)):
                    cache[child] = Cached.of(obj)
            for child in deleted:
                cache.pop(child, None)

    def _reconcile(self, key: ServiceKey) -> None:
        with self._lock:
            rec = self.records.get(key)
        if rec is None:
            return  # deleted: the garbage collector takes the children
        meta = rec.meta
        owner = Owner(name=meta["name"], namespace=meta["namespace"], uid=rec.uid)
        if LEGACY_FINALIZER in (meta.get("finalizers") or []):
            rest = [f for f in meta["finalizers"] if f != LEGACY_FINALIZER]
            self.kube.set_finalizers(owner.namespace, owner.name, rest, meta["resourceVersion"])
            log.info("%s/%s: removed the finalizer of an earlier operator version", *key)
        if meta.get("deletionTimestamp"):
            return

        def emit(kind: str, reason: str, message: str) -> None:
            self.kube.post_event(owner, kind, reason, message)

        spec = rec.validated()
        generation = meta.get("generation")
        if spec is None:
            # The CRD's schema rejects what pydantic rejects; reaching here means a rule drifted.
            if rec.invalid_reported != generation:
                rec.invalid_reported = generation
                emit("Warning", "InvalidSpec", (rec.spec_error or "")[:1000])
                log.error("%s/%s: invalid spec: %s", *key, rec.spec_error)
            return
        if rec.configured is not spec:  # a new generation
            self.telemetry.observe_service(*key, spec)
            unsupported = _hpa_zero(spec)
            if unsupported:
                emit("Warning", "ScaleToZeroUnsupported", unsupported)
            if spec.autoscaling.mode == "Planner":
                if rec.autoscaler is None:
                    rec.autoscaler = ServiceAutoscaler(spec)
                else:
                    rec.autoscaler.configure(spec)
            else:
                rec.autoscaler = None
            rec.configured = spec
        replicas = render.desired_replicas(spec, rec.decision, generation)
        memo = (generation, tuple(sorted(replicas.items())))
        desired = None
        if rec.rendered is None or rec.rendered[0] != memo:
            desired = [stamped(o) for o in render.render(owner, spec, replicas)]
            rec.rendered = (memo, {render.key(o): o["metadata"]["annotations"][INTENT_ANNOTATION] for o in desired})
        intents = rec.rendered[1]
        # Children found in place at this content and intent before are left out of the comparison.
        cached = self._cached(key, rec.uid)
        settled = {k for k, c in cached.items() if rec.settled.get(k) == (c.content_rv, intents.get(k))}
        observed = {k: c.body() for k, c in cached.items() if k not in settled}
        error = None
        try:
            if intents.keys() - settled or observed:  # something to compare: missing, changed or unwanted
                if desired is None:
                    desired = [stamped(o) for o in render.render(owner, spec, replicas)]
                applied, deleted = reconcile_children(
                    self.kube, owner, [o for o in desired if render.key(o) not in settled], observed, emit, rec.known)
            else:
                applied, deleted = {}, []
            self._remember(key, applied, deleted)
            if applied or deleted:
                log.info("%s/%s: applied %d, deleted %d children (generation %s)", *key, len(applied),
                         len(deleted), generation)
            rec.known |= intents.keys()
            for k in observed.keys() & intents.keys() - applied.keys():
                if cached[k].content_rv is not None:
                    rec.settled[k] = (cached[k].content_rv, intents[k])
            for k in deleted:
                rec.settled.pop(k, None)
        except ApiException as e:
            if namespace_terminating(e):
                log.debug("%s/%s: its namespace is being deleted", *key)
                return  # the children it lost go with the namespace; so will the service
            if e.status in (0, None) or e.status >= 500:
                raise  # the API server itself is in trouble: no status write will get through either
            error = f"{e.status} {e.reason}: {api_message(e)}"
        deployments = self._deployments(key, owner)
        kept = rec.status.get("observedGeneration") if error else generation
        new = status.compute_status(owner, spec, deployments, rec.status, rfc3339(time.time()), kept, error,
                                    startup=self.startup_times(key))
        if spec.autoscaling.mode == "Planner" and rec.autoscaling is not None:
            new["autoscaling"] = rec.autoscaling
        rec.status = write_status(self.kube, owner, new, rec.status)
        if error:
            raise RuntimeError(f"apply failed: {error}")

    # ------------------------------------------------------------------ resync

    def _resync_loop(self) -> None:
        while not self.synced.is_set():  # the first LIST: every replica, leader or not
            try:
                self.resync()
                self.synced.set()
            except Exception as e:  # noqa: BLE001 - the API server may not be up yet
                log.warning("listing the InferenceServices and their children failed (again in 5 s): %s", e)
                if self._stop.wait(5.0):
                    return
        while not self._stop.wait(self.settings.resync_s):
            if not self.leading:
                continue
            try:
                self.resync()
            except Exception as e:  # noqa: BLE001 - next period tries again
                log.warning("resync failed: %s", e)

    def resync(self) -> None:
        """Re-list parents and children (what a dropped watch may have missed) and enqueue all."""
        ns = self.settings.namespaces or [None]
        parents: list[dict[str, Any]] = []
        parent_rvs = []
        for n in ns:
            for page in self._pages(PARENT, n):
                parents += page.get("items") or []
                parent_rvs.append(_rv(page) or 0)
        parents_at = min(parent_rvs)
        children: dict[ServiceKey, dict[ChildKey, Cached]] = {}
        listed_at: dict[str, int] = {}  # kind -> the oldest list's resourceVersion
        selector = f"{render.MANAGED_BY_LABEL}={render.MANAGED_BY}"
        for kind in render.CHILD_KINDS:
            for n in ns:
                # Page by page: only one page of full objects is in memory at a time.
                for page in self._pages(kind, n, selector):
                    rv = _rv(page)
                    listed_at[kind.kind] = min(listed_at.get(kind.kind, rv or 0), rv or 0)
                    for item in page.get("items") or []:
                        item.setdefault("apiVersion", kind.api_version)  # a LIST's items carry neither
                        item.setdefault("kind", kind.kind)
                        instance = (item["metadata"].get("labels") or {}).get(render.INSTANCE_LABEL)
                        if instance:
                            key, child = (item["metadata"]["namespace"], instance), (kind.kind, item["metadata"]["name"])
                            children.setdefault(key, {})[child] = self._relisted(key, child, item)
        with self._lock:
            for key, listed_children in children.items():
                cache = self.children.setdefault(key, {})
                for child, entry in listed_children.items():
                    old = cache.get(child)
                    if old is None or old.rv is None or entry.rv is None or entry.rv >= old.rv:
                        cache[child] = entry
            for key, cache in self.children.items():
                for child in [c for c in cache if c not in children.get(key, {})]:
                    # Gone at list time, unless the watch brought it in after the list was taken.
                    if (cache[child].rv or 0) <= listed_at.get(child[0], 0):
                        del cache[child]
            alive = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in parents}
            gone = [k for k, r in self.records.items()
                    if k not in alive and int(r.meta.get("resourceVersion") or 0) <= parents_at]
            for key in gone:
                del self.records[key]
                self.startups.pop(key, None)
        for key in gone:
            self.telemetry.forget(*key)
        for p in parents:
            self.observe_parent(None, p)
        self.enqueue_all()

    def _pages(self, kind: render.ChildKind, namespace: str | None,
               selector: str | None = None) -> Iterable[dict[str, Any]]:
        """A LIST in pages of LIST_PAGE items (one consistent snapshot: the continue token)."""
        token = None
        while True:
            page = self.kube.list(kind, namespace, selector, limit=LIST_PAGE, continue_=token)
            yield page
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    def _relisted(self, key: ServiceKey, child: ChildKey, item: Mapping[str, Any]) -> Cached:
        """The cache entry for a listed child: the one held already when it is that version."""
        with self._lock:
            old = self.children.get(key, {}).get(child)
        if old is not None and old.rv is not None and old.rv == _rv(item):
            return old
        return (old.updated(item) if old is not None and _newer(item, old) else None) or Cached.of(item)

    # ------------------------------------------------------------------ planner loop

    async def _plan_loop(self) -> None:
        limit = asyncio.Semaphore(self.settings.planner_concurrency)
        tasks: set[asyncio.Task] = set()
        async with httpx.AsyncClient(timeout=5.0) as http:
            self._http = http
            await self._plan_ticks(limit, tasks)
        for task in tasks:
            task.cancel()

    async def _plan_ticks(self, limit: asyncio.Semaphore, tasks: set[asyncio.Task]) -> None:
        while not self._stop.is_set():
            if self.leading:
                now = time.time()
                with self._lock:
                    due = [(k, r) for k, r in self.records.items()
                           if r.autoscaler is not None and not r.planning and r.autoscaler.due(now)]
                for key, rec in due:
                    rec.planning = True
                    task = asyncio.create_task(self._plan_one(key, rec, now, limit))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            await asyncio.sleep(self.settings.planner_tick_s)

    async def _plan_one(self, key: ServiceKey, rec: ServiceRecord, now: float, limit: asyncio.Semaphore) -> None:
        try:
            async with limit:
                await self._plan(key, rec, now)
        except Exception:  # noqa: BLE001 - one service's trouble must not stop the loop
            log.exception("%s/%s: autoscaling step failed", *key)
        finally:
            rec.planning = False

    async def _plan(self, key: ServiceKey, rec: ServiceRecord, now: float) -> None:
        scaler, spec = rec.autoscaler, rec.spec
        if scaler is None or spec is None:
            return
        owner = Owner(name=key[1], namespace=key[0], uid=rec.uid)
        deployments = self._deployments(key, owner)
        if any(phase not in deployments for phase in api.PHASES):
            return  # not reconciled yet
        current = {phase: deployments[phase]["desired"] for phase in api.PHASES}
        with self._lock:
            slices = list(self.slices.get(key, {}).values())
        result = await scaler.step(current, endpoint_targets(slices) if not scaler.prometheus else {}, now,
                                   self._http, startup=self.startup_times(key))
        for err in result.errors:
            log.debug("%s/%s metrics: %s", *key, err)
        # What the planner saw, every step (--log-level debug): the status keeps only the decision.
        log.debug("%s/%s planner window: %s", *key, result.snapshot)
        self.telemetry.decided(*key, spec.model.name, result.decision, result.snapshot)
        generation = rec.meta.get("generation")
        before = rec.autoscaling or {}
        patch = status_patch(result.decision, result.snapshot, now, generation, before)
        events = []
        was_stale = any(c.get("type") == "MetricsAvailable" and c.get("status") == "False"
                        for c in before.get("conditions") or [])
        if result.decision.stale and not was_stale:
            events.append(("Warning", "MetricsStale", result.decision.prefill.reason))
        if result.decision.changed:
            d = result.decision
            rec.decision = PlannedReplicas(d.prefill.desired, d.decode.desired, generation)
            events.append(("Normal", "Scaled", d.reason[:1000]))
            log.info("%s/%s autoscaled: %s", *key, d.reason)
            # Scale to zero and back get Events of their own: "scaled to zero after N idle" /
            # "woken by K held requests" (the planner's ScaledToZero condition says which).
            zero = next((c for c in d.conditions if c[0] == "ScaledToZero"), None)
            if zero is not None:
                events.append(("Normal", "ScaledToZero" if zero[1] else "WokenFromZero", zero[3][:1000]))
        if patch != before or result.decision.changed:
            rec.autoscaling = patch
            self.queue.add(key)  # the pass applies the decision and writes the status
        for kind, reason, message in events:
            await asyncio.to_thread(self.kube.post_event, owner, kind, reason, message)
