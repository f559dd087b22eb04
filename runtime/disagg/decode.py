"""The decode worker's half of the remote-prefill protocol: one state machine per request.

Decode-first (docs/architecture.md): the decode worker owns each request from start to end.
The engine reserves the prompt's KV blocks and calls `reserved`; from there a `RemotePrefill`
moves through

    RESERVED ──start──▶ ATTEMPT(url, transfer id) ──K/V + first token in──▶ DONE
                                                  (+ the reply, if logprobs were asked for)
                              │  failed / timed out                           (engine.remote_prefilled)
                              ├──▶ next ATTEMPT (policy retry, retry-local)
                              └──▶ FALLBACK (engine.prefill_locally) or FAILED (engine.fail)
    any state ──engine.release (abort, failure, fallback)──▶ ENDED

An attempt announces its transfer to the KV receiver (which accepts frames only into the
reserved slots), then posts a PrefillCall to a prefill worker; the receiver's DONE frame brings
the first token. A transfer is cancelled at the receiver before its blocks are retried or
freed; if a frame is still landing in them the blocks are kept here (not reused) until the
receiver reports the frame's end, then handed back with engine.release_blocks.

Threads: `reserved` and `release` run on the engine thread, attempts on the event loop, the
receiver's callbacks on its own threads; `lock` guards the transfer table and each transfer's
`tid`/`ended`, so no transfer can start into blocks the engine let go of. Results reach the
engine only through AsyncEngine.call (the engine thread).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import torch

from phasesplit.runtime import internal_secret
from phasesplit.runtime.disagg import placement
from phasesplit.runtime.disagg.messages import PrefillCall, PrefillDone
from phasesplit.runtime.engine.engine import KVConnector, LLMEngine
from phasesplit.runtime.engine.sequence import Sequence
from phasesplit.runtime.engine.step_costs import LinearCost
from phasesplit.runtime.kv.receiver import KVReceiver, Landed
from phasesplit.runtime.kv.sender import TransferFailed
from phasesplit.runtime.server.async_engine import AsyncEngine
from phasesplit.runtime.server.metrics import Metrics

log = logging.getLogger(__name__)


HOP_PRIOR_S = 0.01  # a remote prefill's call, handshake and DONE until round trips are measured


class RemoteError(RuntimeError):
    pass


class RemotePrefill:
    """One request's remote prefill, from its reservation to K/V in place (or fallback/failure)."""

    def __init__(self, seq: Sequence, slots: torch.Tensor) -> None:
        self.request_id = seq.request_id
        self.prompt = list(seq.prompt_ids)
        self.params = seq.params
        self.slots = slots  # cache slot of every prompt position (CPU)
        self.skip = seq.num_computed  # prefix-cache hits here: not sent
        self.tid: int | None = None  # transfer being received into the blocks, if any
        self.ended = False  # the engine dropped the reservation: start no transfer into it
        self.task: asyncio.Task | None = None


class KnownPrefill:
    """The prefill workers this decode worker will call: its static list, or the addresses its
    prefill Service's DNS name resolves to (a headless Service: the ready pods). A URL from a
    request body is used only if it names one of them (no server-side request forgery)."""

    REFRESH_S = 2.0  # a new prefill pod is callable within this of turning ready

    def __init__(self, static_urls: list[str], service: str | None) -> None:
        self.static = {u.rstrip("/") for u in static_urls}
        self.service = service
        self.addresses: set[str] = set()
        self.resolved_at = float("-inf")

    async def filter(self, urls: list[str]) -> list[str]:
        if not urls:
            return []
        if self.service and time.monotonic() - self.resolved_at > self.REFRESH_S:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(self.service, None, type=socket.SOCK_STREAM)
                self.addresses = {i[4][0] for i in infos}
            except OSError as e:
                log.warning("cannot resolve prefill service %s: %s", self.service, e)
            self.resolved_at = time.monotonic()
        known = [u for u in urls if u.rstrip("/") in self.static or _host(u) in self.addresses]
        if len(known) < len(urls):
            log.warning("ignored prefill URLs this worker does not know: %s", sorted(set(urls) - set(known))[:3])
        return known


def _host(url: str) -> str | None:
    parts = urlsplit(url)
    return parts.hostname if parts.scheme == "http" and parts.path in ("", "/") else None


def attempts(urls: list[str], policy: str) -> list[str]:
    """The prefill workers to try, best first, under a failure policy."""
    if policy in ("local", "fail"):
        return urls[:1]
    return urls[:2] if policy == "retry-local" else urls


def _joined(engine: LLMEngine, rid: str, done: Landed, logprob: dict | None = None,
            prompt_logprobs: list | None = None, kv: tuple | None = None) -> None:
    """The landed K/V joins the batch (engine thread)."""
    engine.remote_prefilled(rid, done.first_token, done.seconds, logprob, prompt_logprobs, kv,
                            remote_queued_s=done.remote_queued_s, remote_prefill_s=done.remote_prefill_s)


class DecodeConnector(KVConnector):
    """Runs the remote prefill of reserved requests and applies the failure policy."""

    def __init__(self, aengine: AsyncEngine, receiver: KVReceiver, metrics: Metrics, *, kv_host: str,
                 prefill_urls: list[str], policy: str, timeout: float, local_threshold: int, secret: str,
                 revision: str = "", placement_mode: str = placement.STATIC, itl_target: float | None = None
                 ) -> None:
        self.aengine, self.receiver, self.metrics = aengine, receiver, metrics
        self.kv_host, self.prefill_urls, self.policy, self.timeout = kv_host, prefill_urls, policy, timeout
        self.local_threshold, self.revision = local_threshold, revision
        self.placement_mode, self.itl_target = placement_mode, itl_target
        # Measured round trips of remote prefills (call to K/V in place) by the tokens computed
        # for them, the prefill worker's queue included. Until measured: this worker's own step
        # plus a hop (the same model, likely the same hardware).
        self.remote_cost = LinearCost()
        self.loop: asyncio.AbstractEventLoop | None = None  # bound at start-up
        # request -> (prefill candidates the router ranked, prompt tokens queued on the first)
        self.routes: dict[str, tuple[list[str], int]] = {}
        self.lock = threading.Lock()
        self.transfers: dict[str, RemotePrefill] = {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), headers=internal_secret.headers(secret))

    # -- engine thread (KVConnector) --------------------------------------------------------------

    def costs(self) -> tuple[float, float, float, float]:
        """The fitted costs: this worker's step with prompt tokens (base, per token), a remote
        prefill's round trip (base, per token). Any thread: /internal/state shows them too."""
        base, per_token = self.aengine.engine.prompt_step_fit()
        with self.lock:
            rbase, rper_token = self.remote_cost.fit(prior=(base + HOP_PRIOR_S, per_token))
        return base, per_token, rbase, rper_token

    def figures(self, seq: Sequence) -> placement.Figures:
        """What placement decides on: the measured costs, this worker's batch and queue, and the
        router's view of the prefill worker's queue."""
        sched = self.aengine.engine.scheduler
        base, per_token, rbase, rper_token = self.costs()
        queued = sched.waiting_tokens + sum(s.uncomputed for s in sched.running if s.uncomputed > 1)
        # The chunk a step carries once any stream runs here (one that arrives meanwhile too).
        budget = self.aengine.engine.time_budget()
        step_prompt = None if budget is None else budget.prompt_tokens(max(1, len(sched.running)))
        return placement.Figures(
            prompt_tokens=len(seq.prompt_ids) - seq.num_computed, running=len(sched.running),
            local_queued_tokens=queued, step_budget=sched.budget, local_base_s=base, local_per_token_s=per_token,
            remote_base_s=rbase, remote_per_token_s=rper_token,
            remote_queued_tokens=self.routes.get(seq.request_id, ([], 0))[1], itl_target_s=self.itl_target,
            step_prompt_tokens=step_prompt)

    def reserved(self, seq: Sequence) -> bool:
        """Blocks are reserved: start filling them from a prefill worker, or have the engine
        compute the prompt here where placement says so (placement.py)."""
        f = self.figures(seq)
        d = placement.place(f, have_remote=True, threshold=self.local_threshold, mode=self.placement_mode)
        self.metrics.place(d.where, d.reason)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("placement of %s: %s (%s); here %s s, there %s s; %s", seq.request_id, d.where, d.reason,
                      d.local_s, d.remote_s, f)
        if d.where == placement.LOCAL:
            self.routes.pop(seq.request_id, None)
            return False
        if self.aengine.engine.config.remote_pause_target_s:  # LLMEngine.remote_pause weighs it
            seq.remote_started = time.monotonic()
            seq.remote_estimate_s = d.remote_s if d.remote_s is not None else placement.remote_seconds(
                f, f.remote_queued_tokens)
        t = RemotePrefill(seq, self.aengine.engine.runner.slots(seq, 0, len(seq.prompt_ids)).cpu())
        with self.lock:
            self.transfers[t.request_id] = t
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._start, t)
        return True

    def release(self, seq: Sequence) -> bool:
        """The reservation is being dropped. True when no K/V frame is landing in it; otherwise
        the blocks stay out of use until the receiver reports the frame's end."""
        with self.lock:
            t = self.transfers.get(seq.request_id)
            if t is None:
                return True
            t.ended = True
            tid = t.tid
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._stop, t)
        if tid is None:
            return True
        blocks = seq.block_table
        return self.receiver.cancel(tid, lambda: self.aengine.call(lambda e: e.release_blocks(blocks)))

    # -- event loop -------------------------------------------------------------------------------

    def route(self, request_id: str, urls: list[str], queued_tokens: int = 0) -> None:
        """The router's ranking of prefill workers for a request about to be added, and the
        prompt tokens the first had queued when the router last looked."""
        self.routes[request_id] = (urls, queued_tokens)

    def forget(self, request_id: str) -> None:
        self.routes.pop(request_id, None)

    def _start(self, t: RemotePrefill) -> None:
        with self.lock:
            if t.ended:  # aborted before the loop got here
                if self.transfers.get(t.request_id) is t:
                    del self.transfers[t.request_id]
                return
        t.task = asyncio.ensure_future(self._run(t))

    def _stop(self, t: RemotePrefill) -> None:
        if t.task is not None and not t.task.done():
            t.task.cancel()

    async def _run(self, t: RemotePrefill) -> None:
        errors = []
        rid = t.request_id
        try:
            urls, queued = self.routes.pop(rid, None) or (list(self.prefill_urls), 0)
            for i, url in enumerate(attempts(urls, self.policy)):
                if t.ended:  # aborted or failed meanwhile: nothing to fall back for
                    return
                try:
                    await self._attempt(url, t, queued if i == 0 else 0)
                    return
                except (httpx.HTTPError, TransferFailed, asyncio.TimeoutError, RemoteError) as e:
                    self.metrics.child(self.metrics.kv_failures).inc()
                    errors.append(f"{url}: {e or type(e).__name__}")
                    log.warning("remote prefill of %s via %s failed: %s", rid, url, e or type(e).__name__)
            why = "; ".join(errors) or "no prefill worker available"
            if self.policy in ("local", "retry-local"):
                self.metrics.place(placement.LOCAL, placement.REMOTE_FAILED)
                self.aengine.call(lambda e: e.prefill_locally(rid))
            else:
                self.aengine.call(lambda e: e.fail(rid, f"prefill failed: {why}"))
        finally:
            with self.lock:
                if self.transfers.get(rid) is t:
                    del self.transfers[rid]

    async def _attempt(self, url: str, t: RemotePrefill, queued: int) -> None:
        # Random 64-bit ids: a peer cannot guess a transfer it was not given.
        rid, tid = t.request_id, secrets.randbits(64)
        done = asyncio.Event()
        failure: list[str] = []
        loop = asyncio.get_running_loop()

        # Logprobs come in the prefill's reply, not on the KV stream: a request that asked for
        # them joins the batch once both are in; others as soon as the K/V has landed.
        p = t.params
        with_logprobs = p.logprobs is not None or p.prompt_logprobs is not None
        landed: list[Landed] = []

        # A tensor-parallel decode worker receives every head into a buffer of its own, which
        # the engine scatters to the ranks when the request joins the batch (remote_prefilled).
        landing = self.aengine.engine.runner.kv_landing(len(t.prompt))
        kv = None if landing is None else (t.skip, landing[:, :, t.skip :])

        started = time.monotonic()

        def on_done(done_: Landed) -> None:  # receiver thread
            with self.lock:  # the round trip, for placement: the tokens ahead of it and its own
                self.remote_cost.observe(queued + len(t.prompt) - t.skip, time.monotonic() - started)
            self.metrics.child(self.metrics.kv_bytes).inc(done_.bytes)
            self.metrics.child(self.metrics.kv_transfer).observe(done_.seconds)
            if with_logprobs:
                landed.append(done_)
            else:
                self.aengine.call(lambda e: _joined(e, rid, done_, kv=kv))
            loop.call_soon_threadsafe(done.set)

        def on_fail(why: str) -> None:  # receiver thread
            failure.append(why)
            loop.call_soon_threadsafe(done.set)

        with self.lock:
            if t.ended:
                raise RemoteError("the request ended before its prefill started")
            self.receiver.expect(tid, t.slots, t.skip, on_done, on_fail, landing)
            t.tid = tid
        call = PrefillCall(request_id=rid, prompt_ids=t.prompt, params=t.params, kv_host=self.kv_host,
                           kv_port=self.receiver.port, transfer_id=tid, skip=t.skip, revision=self.revision)
        try:
            # asyncio.wait_for, not asyncio.timeout: the runtime supports Python 3.10.
            try:
                reply = await asyncio.wait_for(self._call_and_wait(url, call, done), self.timeout)
            except (RemoteError, httpx.HTTPError) as e:
                if failure:  # the receiver refused the transfer and says why; the prefill worker only that it was
                    raise RemoteError(f"{failure[0]} (prefill worker: {e})") from None
                raise
            if failure:
                raise RemoteError(failure[0])
            if landed:
                self.aengine.call(lambda e: _joined(e, rid, landed[0], reply.logprob, reply.prompt_logprobs, kv))
        finally:
            # Late frames of this attempt can no longer land; one already landing is waited for
            # (its connection is cut, so it ends at once) before the blocks are retried or freed.
            released = asyncio.Event()
            if not self.receiver.cancel(tid, lambda: loop.call_soon_threadsafe(released.set)):
                await released.wait()
            with self.lock:
                if t.tid == tid:
                    t.tid = None

    async def _call_and_wait(self, url: str, call: PrefillCall, done: asyncio.Event) -> PrefillDone:
        r = await self.client.post(url + "/internal/prefill", json=call.model_dump(mode="json"))
        if r.status_code != 200:
            raise RemoteError(f"HTTP {r.status_code}: {r.text[:200]}")
        try:
            reply = PrefillDone.model_validate_json(r.content)
        except ValueError as e:
            raise RemoteError(f"bad reply: {e}") from None
        await done.wait()
        return reply
