"""Prefill and decode worker apps (split mode). The router lives in router.py.

Decode-first (DESIGN.md): the decode worker owns each request from start to end. It reserves KV
blocks, asks a prefill worker to fill them, and applies the failure policy itself, so a dead or
slow prefill worker strands nothing.

Internal endpoints (not for clients):
- decode  POST /internal/generate  {request_id, prompt_ids, params, prefill_urls} -> NDJSON outputs
- prefill POST /internal/prefill   {request_id, prompt_ids, params, kv_host, kv_port, transfer_id, skip}
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from phasesplit.runtime.engine.engine import KVExport, LLMEngine, RequestError, RequestOutput
from phasesplit.runtime.engine.sampling import SamplingParams
from phasesplit.runtime.engine.scheduler import ScheduledBatch
from phasesplit.runtime.engine.sequence import Sequence
from phasesplit.runtime.kv.receiver import KVReceiver
from phasesplit.runtime.kv.sender import KVSender, TransferFailed
from phasesplit.runtime.model.attention import read_rows
from phasesplit.runtime.server.async_engine import AsyncEngine
from phasesplit.runtime.server.launch import add_debug_routes, build_engine
from phasesplit.runtime.server.metrics import Metrics
from phasesplit.runtime.server.openai_api import add_common_routes, install_error_handlers
from phasesplit.runtime.server.protocol import error_body

log = logging.getLogger(__name__)


class GenerateCall(BaseModel):
    request_id: str
    prompt_ids: list[int] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    prefill_urls: list[str] = Field(default_factory=list)


class PrefillCall(BaseModel):
    request_id: str
    prompt_ids: list[int] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    kv_host: str
    kv_port: int
    transfer_id: int
    skip: int = 0


def params_from(d: dict[str, Any]) -> SamplingParams:
    try:
        p = SamplingParams(**d)
    except TypeError as e:
        raise RequestError(f"bad sampling parameters: {e}") from None
    return p


def output_line(out: RequestOutput) -> bytes:
    return (json.dumps(asdict(out)) + "\n").encode()


def _state(engine: LLMEngine) -> dict[str, Any]:
    sched = engine.scheduler
    # Prompt tokens still to compute, part-way prompts included: what the router balances on.
    partial = sum(s.uncomputed for s in sched.running if s.uncomputed > 1)
    return {"running": len(sched.running), "waiting": len(sched.waiting) + len(engine.remote_waiting),
            "waiting_tokens": sched.waiting_tokens, "queued_tokens": sched.waiting_tokens + partial,
            "free_blocks": engine.blocks.num_free, "total_blocks": engine.blocks.num_blocks}


def build_split_app(args: argparse.Namespace) -> FastAPI:
    if args.role == "prefill":
        return build_prefill_app(args)
    if args.role == "decode":
        return build_decode_app(args)
    from phasesplit.runtime.server.router import build_router_app

    return build_router_app(args)


# -- prefill worker -----------------------------------------------------------------------------


class LayerStreamer(KVExport):
    """Copies each finished layer's new K/V out of the cache and hands it to the request's sender."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.senders: dict[str, tuple[KVSender, list[int]]] = {}  # request -> (sender, [sent_upto])
        self.items: list[tuple[Sequence, int, int, KVSender]] = []

    def begin(self, batch: ScheduledBatch) -> None:
        self.items = []
        for seq, chunk in batch.prefill:
            entry = self.senders.get(seq.request_id)
            if entry is None:
                continue
            sender, upto = entry
            hi = seq.num_computed + chunk  # this step computes up to here
            if hi > upto[0]:  # includes prefix-cache hits on the first chunk: the decoder lacks them
                self.items.append((seq, upto[0], hi, sender))
                upto[0] = hi

    def layer_done(self, layer: int) -> None:
        cache = self.engine.runner.kv_cache
        for seq, lo, hi, sender in self.items:
            slots = self.engine.runner.slots(seq, lo, hi)
            k, v = read_rows(cache[0, layer], slots), read_rows(cache[1, layer], slots)
            sender.send_layer(layer, lo, torch.stack((k, v)).to("cpu"))


def build_prefill_app(args: argparse.Namespace) -> FastAPI:
    engine, metrics, name = build_engine(args, "prefill")
    streamer = LayerStreamer(engine)
    engine.kv_export = streamer
    aengine = AsyncEngine(engine)
    app = FastAPI(title="phasesplit prefill worker", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    add_common_routes(app, metrics, ready=lambda: (aengine.error is None, str(aengine.error or "ok")))
    add_debug_routes(app, engine)
    app.router.on_shutdown.append(aengine.shutdown)

    @app.get("/internal/state")
    async def state() -> dict[str, Any]:
        return _state(engine)

    @app.post("/internal/prefill")
    async def prefill(call: PrefillCall) -> JSONResponse:
        try:
            params = params_from(call.params)
            engine.check_request(len(call.prompt_ids), params)
        except RequestError as e:
            return JSONResponse(error_body(str(e), param=e.param), status_code=400)
        t0 = time.monotonic()
        sender = KVSender((call.kv_host, call.kv_port), call.transfer_id, timeout=args.prefill_timeout)
        rid = f"{call.request_id}/{call.transfer_id}"
        streamer.senders[rid] = (sender, [call.skip])
        first: int | None = None
        try:
            async for out in aengine.generate(rid, call.prompt_ids, params, prefill_only=True):
                first = out.new_token_ids[0]
            assert first is not None
            sender.finish(first)
            sent = await asyncio.to_thread(sender.wait, args.prefill_timeout)
        except (TransferFailed, RuntimeError) as e:
            sender.abort()
            metrics.child(metrics.kv_failures).inc()
            log.warning("prefill of %s failed: %s", rid, e)
            return JSONResponse(error_body(str(e), "server_error"), status_code=502)
        finally:
            streamer.senders.pop(rid, None)
            if first is None:
                sender.abort()
        seconds = time.monotonic() - t0
        metrics.child(metrics.kv_bytes).inc(sent)
        metrics.child(metrics.kv_transfer).observe(seconds)
        return JSONResponse({"first_token": first, "bytes": sent, "seconds": seconds})

    return app


# -- decode worker ------------------------------------------------------------------------------


class _Remote:
    """A reserved request's remote prefill, shared by the engine thread and the event loop."""

    def __init__(self) -> None:
        self.tid: int | None = None  # transfer being received into its blocks, if any
        self.ended = False  # the engine dropped the reservation: start no transfer into it


class RemotePrefill:
    """Runs the remote prefill of reserved requests and applies the failure policy."""

    def __init__(self, args: argparse.Namespace, aengine: AsyncEngine, receiver: KVReceiver,
                 metrics: Metrics, kv_host: str) -> None:
        self.args, self.aengine, self.receiver, self.metrics = args, aengine, receiver, metrics
        self.kv_host = kv_host
        self.loop: asyncio.AbstractEventLoop | None = None
        self.urls: dict[str, list[str]] = {}  # request -> prefill candidates, best first
        self.tasks: dict[str, asyncio.Task] = {}
        # Guards `remote` between the engine thread (reservations end there) and the event loop
        # (transfers start there), so no transfer can start into blocks the engine let go of.
        self.lock = threading.Lock()
        self.remote: dict[str, _Remote] = {}
        self.ids = itertools.count(int(time.time() * 1000) << 16)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(args.prefill_timeout, connect=5.0))

    def on_reserved(self, seq: Sequence) -> None:
        """Engine thread: blocks are reserved; start filling them from a prefill worker."""
        slots = self.aengine.engine.runner.slots(seq, 0, len(seq.prompt_ids)).cpu()
        skip = seq.num_computed
        with self.lock:
            self.remote[seq.request_id] = _Remote()
        args = (seq.request_id, list(seq.prompt_ids), asdict(seq.params), slots, skip)
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._start, *args)

    def on_remote_end(self, seq: Sequence, key: int) -> bool:
        """Engine thread: the reservation is being dropped (abort, failure, local fallback).
        Returns True when no K/V frame is landing in it; otherwise the engine holds the blocks
        until the receiver reports the frame's end (`release_held(key)`)."""
        rid = seq.request_id
        with self.lock:
            st = self.remote.get(rid)
            if st is None:
                return True
            st.ended = True
            tid = st.tid
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._stop, rid)
        if tid is None:
            return True
        return self.receiver.cancel(tid, lambda: self.aengine.call(lambda e: e.release_held(key)))

    def _start(self, rid: str, prompt: list[int], params: dict, slots, skip: int) -> None:
        with self.lock:
            st = self.remote.get(rid)
            if st is None or st.ended:  # aborted before the loop got here
                self.remote.pop(rid, None)
                return
        self.tasks[rid] = asyncio.ensure_future(self._run(rid, st, prompt, params, slots, skip))

    def _stop(self, rid: str) -> None:
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    def _attempts(self, rid: str) -> list[str]:
        urls = self.urls.pop(rid, []) or list(self.args.prefill_urls)
        policy = self.args.on_prefill_failure
        return urls[:1] if policy in ("local", "fail") else urls[:2] if policy == "retry-local" else urls

    async def _run(self, rid: str, st: _Remote, prompt: list[int], params: dict, slots, skip: int) -> None:
        errors = []
        try:
            for url in self._attempts(rid):
                if st.ended:  # aborted or failed meanwhile: nothing to fall back for
                    return
                try:
                    await self._attempt(url, rid, st, prompt, params, slots, skip)
                    return
                except (httpx.HTTPError, TransferFailed, asyncio.TimeoutError, RemoteError) as e:
                    self.metrics.child(self.metrics.kv_failures).inc()
                    errors.append(f"{url}: {e or type(e).__name__}")
                    log.warning("remote prefill of %s via %s failed: %s", rid, url, e or type(e).__name__)
            why = "; ".join(errors) or "no prefill worker available"
            if self.args.on_prefill_failure in ("local", "retry-local"):
                self.metrics.child(self.metrics.local_prefill).inc()
                self.aengine.call(lambda e: e.prefill_locally(rid))
            else:
                self.aengine.call(lambda e: e.fail(rid, f"prefill failed: {why}"))
        finally:
            with self.lock:
                if self.remote.get(rid) is st:
                    del self.remote[rid]
            if self.tasks.get(rid) is asyncio.current_task():
                del self.tasks[rid]

    async def _attempt(self, url: str, rid: str, st: _Remote, prompt: list[int], params: dict, slots,
                       skip: int) -> None:
        tid = next(self.ids)
        done = asyncio.Event()
        failure: list[str] = []
        loop = asyncio.get_running_loop()

        def on_done(first_token: int, nbytes: int, seconds: float) -> None:  # receiver thread
            self.metrics.child(self.metrics.kv_bytes).inc(nbytes)
            self.metrics.child(self.metrics.kv_transfer).observe(seconds)
            self.aengine.call(lambda e: e.complete_remote(rid, first_token, seconds))
            loop.call_soon_threadsafe(done.set)

        def on_fail(why: str) -> None:  # receiver thread
            failure.append(why)
            loop.call_soon_threadsafe(done.set)

        with self.lock:
            if st.ended:
                raise RemoteError("the request ended before its prefill started")
            self.receiver.expect(tid, slots, skip, on_done, on_fail)
            st.tid = tid
        body = {"request_id": rid, "prompt_ids": prompt, "params": params, "kv_host": self.kv_host,
                "kv_port": self.receiver.port, "transfer_id": tid, "skip": skip}
        try:
            async with asyncio.timeout(self.args.prefill_timeout):
                r = await self.client.post(url + "/internal/prefill", json=body)
                if r.status_code != 200:
                    raise RemoteError(f"HTTP {r.status_code}: {r.text[:200]}")
                await done.wait()
            if failure:
                raise RemoteError(failure[0])
        finally:
            # Late frames of this attempt can no longer land; one already landing is waited for
            # (its connection is cut, so it ends at once) before the blocks are retried or freed.
            released = asyncio.Event()
            if not self.receiver.cancel(tid, lambda: loop.call_soon_threadsafe(released.set)):
                await released.wait()
            with self.lock:
                if st.tid == tid:
                    st.tid = None


class RemoteError(RuntimeError):
    pass


def build_decode_app(args: argparse.Namespace) -> FastAPI:
    engine, metrics, name = build_engine(args, "decode")
    kv_host = args.kv_host or args.host
    receiver = KVReceiver(args.host if args.host != "0.0.0.0" else "", args.kv_port, engine.runner.kv_cache,
                          on_bytes=None)
    aengine = AsyncEngine(engine)
    remote = RemotePrefill(args, aengine, receiver, metrics, kv_host)
    engine.on_reserved = remote.on_reserved
    engine.on_remote_end = remote.on_remote_end
    app = FastAPI(title="phasesplit decode worker", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    add_common_routes(app, metrics, ready=lambda: (aengine.error is None, str(aengine.error or "ok")))
    add_debug_routes(app, engine)

    @app.on_event("startup")
    async def _bind_loop() -> None:
        remote.loop = asyncio.get_running_loop()
        log.info("KV receiver on port %d (advertised as %s)", receiver.port, kv_host)

    @app.on_event("shutdown")
    async def _stop() -> None:
        receiver.close()
        aengine.shutdown()

    @app.get("/internal/state")
    async def state() -> dict[str, Any]:
        return {**_state(engine), "kv_port": receiver.port, "kv_rejected": receiver.rejected}

    @app.post("/internal/generate")
    async def generate(call: GenerateCall, request: Request):
        try:
            params = params_from(call.params)
            engine.check_request(len(call.prompt_ids), params)
        except RequestError as e:
            return JSONResponse(error_body(str(e), param=e.param), status_code=400)
        urls = call.prefill_urls or list(args.prefill_urls)
        local = not urls or len(call.prompt_ids) <= args.local_prefill_threshold
        if local:
            metrics.child(metrics.local_prefill).inc()
        else:
            remote.urls[call.request_id] = urls

        async def lines() -> AsyncIterator[bytes]:
            outputs = aengine.generate(call.request_id, call.prompt_ids, params, remote=not local)
            try:
                async for out in outputs:
                    yield output_line(out)
            except Exception as e:  # noqa: BLE001 - the router turns this into an error event
                yield (json.dumps({"error": str(e)}) + "\n").encode()
            finally:
                # The abort reaches the engine, which stops the transfer (engine.on_remote_end)
                # and frees the blocks, or holds them while a frame is still landing in them.
                remote.urls.pop(call.request_id, None)
                await outputs.aclose()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app
