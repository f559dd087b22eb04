"""The router: the OpenAI API in front of prefill and decode pools.

It tokenizes, validates (the one check of this process), picks a decode worker and ranks prefill
workers (the rules in routing.py), and relays the decode worker's stream; with --lend-idle-prefill
an idle prefill worker may serve a whole request instead (routing.lend_prefill). A request that
finds no worker of a phase it needs (a phase scaled to zero, workers not ready yet) waits in the
held queue (held.py) until one is up. Its TTFT/ITL histograms include queueing and KV transfer:
the ones the autoscaler reads. It runs no model: it reads only the tokenizer and config
(model/files.py) and never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict

import httpx
from fastapi import FastAPI

from phasesplit.runtime import internal_secret
from phasesplit.runtime.disagg.messages import GenerateCall
from phasesplit.runtime.engine.grammar import GrammarError, grammar_text
from phasesplit.runtime.model.files import ModelFiles, model_info, read_config
from phasesplit.runtime.model.tokenizer import TextTokenizer
from phasesplit.runtime.request import Overloaded, RequestError, RequestOutput, SamplingParams, Unavailable
from phasesplit.runtime.server.admission import Admission, Ticket
from phasesplit.runtime.server.held import HeldQueue
from phasesplit.runtime.server.metrics import Metrics
from phasesplit.runtime.server.openai_api import build_openai_app, served_names
from phasesplit.runtime.server.routing import (
    Pool,
    Worker,
    lend_prefill,
    missing_phase,
    pick_decode,
    rank_prefill,
)

log = logging.getLogger(__name__)

# A request tries this many times to reach a worker whose connection failed before it gives up with
# 503: a connect that failed started nothing, so trying again (elsewhere, or once a poll finds the
# worker back) is safe; a bound keeps a dead pool from looping.
MAX_UNREACHED = 3
UNREACHED_RETRY_AFTER_S = 2


class RemoteBackend:
    """The OpenAI layer's backend in split mode: relays to a decode worker."""

    def __init__(self, args: argparse.Namespace, files: ModelFiles, metrics: Metrics, secret: str) -> None:
        self.tokenizer = TextTokenizer(files.folder)
        cfg = read_config(files)
        self.max_model_len = min(args.max_model_len or cfg.max_position, cfg.max_position)
        self.metrics = metrics
        self.decode, self.prefill = Pool(), Pool()
        self.decode.set_urls(list(args.decode_urls))
        self.prefill.set_urls(list(args.prefill_urls))
        self.rng = random.Random(0)
        # Admission: per live decode worker, its running batch plus its queue, and its KV cache's
        # tokens plus a backlog (the workers' own defaults, so the router refuses first).
        self.per_worker = args.max_num_seqs + (args.max_queued_requests if args.max_queued_requests is not None
                                               else 4 * args.max_num_seqs)
        self.queued_tokens = args.max_queued_tokens
        self.block_size = args.block_size
        self.admission = Admission(self.per_worker, 0)
        # Requests that find no worker wait here (bounded in number and time) until one is up.
        self.need_prefill = args.hold_for_prefill
        self.held = HeldQueue(args.max_held, args.hold_timeout,
                              on_wait=lambda s: metrics.child(metrics.held_wait).observe(s))
        # Client streams and worker polls in separate pools, so polls never wait behind streams.
        # The read timeout holds per chunk: a decode worker silent that long fails its requests.
        internal = internal_secret.headers(secret)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=3.0, read=args.worker_read_timeout, write=10.0, pool=10.0),
            limits=httpx.Limits(max_connections=self.per_worker * max(4, len(args.decode_urls)),
                                max_keepalive_connections=self.per_worker), headers=internal)
        self.poll_client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), limits=httpx.Limits(max_connections=32),
                                             headers=internal)
        self.poll_interval = args.worker_poll_interval
        self.lend = args.lend_idle_prefill  # whole requests to idle prefill workers (routing.lend_prefill)
        self.polled = False  # a first round of polls has ended: `live()` means something

    def check_request(self, prompt_len: int, params: SamplingParams) -> None:
        params.validate(self.tokenizer.vocab_size)
        if prompt_len + params.max_tokens > self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens; the "
                               f"request has {prompt_len} prompt tokens plus max_tokens={params.max_tokens}",
                               "max_tokens")
        if params.guided is not None:  # a bad schema is the client's 400 here, before any worker sees it
            try:
                grammar_text(params.guided)
            except GrammarError as e:
                raise RequestError(str(e), e.param) from None

    def capacity(self) -> int:
        live = len(self.decode.live())
        return self.per_worker * live if live else self.held.max_held

    def admit(self, prompt_tokens: int, seqs: int = 1) -> Ticket:
        live = self.decode.live()
        if not live:  # it will be held (generate): the held queue's bound is the limit then
            return self.admission.admit(prompt_tokens, seqs, max_requests=sys.maxsize, max_tokens=sys.maxsize)
        kv_tokens = [w.total_blocks * self.block_size for w in live]
        max_tokens = sum(t + (self.queued_tokens if self.queued_tokens is not None else 4 * t) for t in kv_tokens)
        return self.admission.admit(prompt_tokens, seqs, max_requests=self.per_worker * len(live),
                                    max_tokens=max_tokens)

    async def poll_forever(self) -> None:
        while True:
            workers = list(self.decode.workers.values()) + list(self.prefill.workers.values())
            await asyncio.gather(*(self._poll(w) for w in workers))
            self.polled = True
            self.held.changed()
            await asyncio.sleep(self.poll_interval)

    async def _poll(self, w: Worker) -> None:
        try:
            r = await self.poll_client.get(w.url + "/internal/state")
            if r.status_code == 503 and r.json().get("draining"):
                if w.up:
                    log.info("worker %s is draining: no new requests go to it", w.url)
                w.up = False
                return
            r.raise_for_status()
            s = r.json()
        except (httpx.HTTPError, ValueError):
            if w.up:
                log.warning("worker %s is down", w.url)
            w.up = False
            return
        if not w.up:
            log.info("worker %s is up", w.url)
        w.up, w.last_seen, w.inflight = True, time.monotonic(), 0
        w.free_blocks, w.total_blocks = s["free_blocks"], s["total_blocks"]
        w.running, w.waiting, w.waiting_tokens = s["running"], s["waiting"], s["waiting_tokens"]
        w.queued_tokens = s["queued_tokens"]
        w.revision = s.get("revision", "")
        w.takes_requests = bool(s.get("takes_requests"))
        w.next_step_s, w.itl_target_s = s.get("next_step_s"), s.get("itl_target_s")

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        arrival = time.monotonic()  # TTFT as the client sees it: a held request's wait included
        tried: set[str] = set()
        unreached = 0
        while True:
            await self.held.wait(lambda: missing_phase(self.decode, self.prefill, self.need_prefill, tried))
            worker = pick_decode(self.decode, exclude=tried,
                                 prefill_revisions={w.revision for w in self.prefill.live()})
            if worker is None:  # missing_phase just found one; nothing ran in between
                raise RuntimeError("no decode worker is available")
            lent = lend_prefill(self.prefill, worker, exclude=tried) if self.lend else None
            target = lent or worker
            tried.add(target.url)
            started = False
            try:
                async for out in self._generate_on(target, request_id, prompt_ids, params, arrival,
                                                   whole=lent is not None):
                    started = True
                    yield out
                return
            except _Draining:
                target.up = False  # until a poll finds it ready again
                log.info("worker %s is draining; trying another", target.url)
            except _Unreached as e:
                # Marked down (in _generate_on) until a poll finds it up again; not excluded, so a
                # lone worker that was only slow to accept gets the request once it is back, while
                # the held queue bounds the wait.
                unreached += 1
                if unreached >= MAX_UNREACHED:
                    raise Unavailable(f"{e} ({unreached} tries); retry later", UNREACHED_RETRY_AFTER_S) from None
                tried.discard(target.url)
                log.warning("%s; trying again", e)
            except (Overloaded, RuntimeError):
                if lent is None or started:
                    raise
                # A lent prefill worker was only ever an extra: full or failed before its first
                # output, the request goes to the decode pool as it would have.

    async def _generate_on(self, worker: Worker, request_id: str, prompt_ids: list[int], params: SamplingParams,
                           start: float, whole: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream the request from `worker`: a decode worker, given the prefill workers to try, or
        (`whole`) a prefill worker lent the whole request, which prefills its prompt itself."""
        prefill = [] if whole else rank_prefill(self.prefill, self.rng, prompt_ids, revision=worker.revision)
        queued = prefill[0].queued_tokens if prefill else 0  # ahead of this prompt
        home = worker if whole else next(iter(prefill), None)  # where this prompt will be prefilled
        if home is not None:
            home.waiting_tokens += len(prompt_ids)
            home.queued_tokens += len(prompt_ids)
        worker.inflight += 1
        m = self.metrics
        if whole:
            m.child(m.lent).inc()
        role = "prefill worker" if whole else "decode worker"
        body = GenerateCall(request_id=request_id, prompt_ids=prompt_ids, params=params,
                            prefill_urls=[w.url for w in prefill], prefill_queued_tokens=queued
                            ).model_dump(mode="json")
        last = None
        pending = params.num_seqs
        try:
            async with self.client.stream("POST", worker.url + "/internal/generate", json=body) as r:
                if r.status_code == 503:  # draining (a stale pick): nothing was started there
                    raise _Draining()
                if r.status_code in (400, 429):
                    err = json.loads(await r.aread()).get("error", {})
                    if r.status_code == 429:
                        raise Overloaded(err.get("message", f"the {role} is at capacity"),
                                         int(r.headers.get("retry-after", "1")))
                    raise RequestError(err.get("message", "bad request"), err.get("param"))
                if r.status_code != 200:
                    raise RuntimeError(f"{role} {worker.url} answered HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    d = json.loads(line)
                    if d.get("error"):
                        raise RuntimeError(d["error"])
                    out = RequestOutput.from_dict(d)
                    now = time.monotonic()
                    if out.new_token_ids:
                        if last is None:
                            m.child(m.ttft).observe(now - start)
                        else:
                            m.child(m.itl).observe(now - last)
                        last = now
                        m.child(m.generation_tokens).inc(len(out.new_token_ids))
                    yield out
                    if out.finished:
                        pending -= 1  # each of an n > 1 request's choices ends on its own
                    if pending == 0:
                        m.child(m.e2e).observe(now - start)
                        m.child(m.prompt_tokens).inc(out.prompt_tokens)
                        m.success.labels(**m.labels, finished_reason=out.finish_reason or "stop").inc()
                        return
            raise RuntimeError(f"{role} {worker.url} closed the stream before the request finished")
        except httpx.PoolTimeout:  # every connection to the workers is busy: the router is full
            raise Overloaded("the router has no free connection to a decode worker; retry later") from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            # Refused or not accepted in time: gone, or starved. Nothing started on it.
            worker.up = False
            raise _Unreached(f"{role} {worker.url} could not be reached: {str(e) or type(e).__name__}") from None
        except httpx.HTTPError as e:
            # Dead, or hung past the read timeout: routed around until the next successful poll.
            log.warning("%s %s failed: %s", role, worker.url, str(e) or type(e).__name__)
            worker.up = False
            raise RuntimeError(f"{role} {worker.url} failed: {str(e) or type(e).__name__}") from None


class _Draining(Exception):
    """The decode worker refused the request because it is shutting down."""


class _Unreached(Exception):
    """The connection to the worker failed: the request never reached it."""


def slice_urls(obj) -> list[str]:
    """Worker URLs of one EndpointSlice: ready endpoints that are not terminating (a pod being
    deleted, in its preStop delay or draining, takes no new requests), on the port named http
    (or the first)."""
    ports = obj.ports or []
    port = next((p.port for p in ports if p.name == "http"), ports[0].port if ports else 8000)
    return [f"http://{addr}:{port}" for ep in obj.endpoints or [] if _routable(ep.conditions)
            for addr in ep.addresses]


def _routable(conditions) -> bool:
    return conditions is None or (conditions.ready is not False and not conditions.terminating)


def watch_kubernetes(pools: dict[str, Pool], namespace: str, api_client=None,
                     stop: threading.Event | None = None) -> None:
    """Keep each pool equal to the ready endpoints of its Service (pools: service name -> Pool).

    A watch on the Services' EndpointSlices, resumed after every timeout or API error, so a pod
    that turns ready or goes away is seen within moments rather than at the next poll.
    """
    from kubernetes import client, watch

    api = client.DiscoveryV1Api(api_client)
    slices: dict[str, tuple[str, list[str]]] = {}  # slice name -> (service, urls)
    selector = "kubernetes.io/service-name in ({})".format(",".join(pools))
    while stop is None or not stop.is_set():
        try:
            w = watch.Watch()
            for ev in w.stream(api.list_namespaced_endpoint_slice, namespace, label_selector=selector,
                               timeout_seconds=30):
                obj = ev["object"]
                if ev["type"] == "DELETED":
                    slices.pop(obj.metadata.name, None)
                else:
                    slices[obj.metadata.name] = (obj.metadata.labels.get("kubernetes.io/service-name"),
                                                 slice_urls(obj))
                for svc, pool in pools.items():
                    pool.set_urls(sorted({u for s, us in slices.values() if s == svc for u in us}))
                if stop is not None and stop.is_set():
                    return
        except Exception as e:  # noqa: BLE001 - API hiccups must not kill discovery
            log.warning("endpoint watch failed, retrying: %s", e)
            time.sleep(2)


def _kubernetes_discovery(backend: RemoteBackend, args: argparse.Namespace) -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    pools = {args.prefill_service: backend.prefill, args.decode_service: backend.decode}
    watch_kubernetes(pools, args.namespace or _own_namespace())


def _own_namespace() -> str:
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    return "default"


def build_router_app(args: argparse.Namespace) -> FastAPI:
    files = model_info(args.model)  # tokenizer and config only: no weights
    names = served_names(args, files.name)
    name = names[0]
    metrics = Metrics(name, "router")
    secret = internal_secret.load()
    backend = RemoteBackend(args, files, metrics, secret)
    def kv_usage() -> float:  # the decode pool's, as the router last saw it
        live = backend.decode.live()
        total = sum(w.total_blocks for w in live)
        return 1.0 - sum(w.free_blocks for w in live) / total if total else 0.0

    metrics.bind(running=lambda: sum(w.running for w in backend.decode.live()),
                 waiting=lambda: sum(w.waiting for w in backend.decode.live() + backend.prefill.live()),
                 kv_usage=kv_usage,
                 queue_tokens=lambda: sum(w.waiting_tokens for w in backend.prefill.live()))
    metrics.child(metrics.held).set_function(lambda: backend.held.held)

    def ready() -> tuple[bool, str]:
        # With no worker up the router still takes requests when it can hold them (a phase scaled
        # to zero: its Service must keep routing to the router, whose held count wakes the phases).
        if not backend.decode.live():
            if backend.polled and backend.held.timeout_s > 0:
                return True, f"no decode worker is up: requests are held up to {backend.held.timeout_s:g}s"
            return False, "no decode worker is up"
        return True, "ok"

    app = build_openai_app(backend, names, metrics, ready, api_key=os.environ.get(args.api_key_env),
                           secret=secret, max_body=args.max_body_bytes)

    @app.on_event("startup")
    async def _start() -> None:
        if args.discovery == "kubernetes":
            threading.Thread(target=_kubernetes_discovery, args=(backend, args), daemon=True).start()
        app.state.poller = asyncio.create_task(backend.poll_forever())

    @app.get("/internal/workers")
    async def workers() -> dict:
        return {"decode": [asdict(w) for w in backend.decode.workers.values()],
                "prefill": [asdict(w) for w in backend.prefill.workers.values()]}

    return app
