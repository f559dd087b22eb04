"""Prefill and decode worker apps (split mode): HTTP only. The router lives in router.py, the
remote-prefill protocol in runtime/disagg (messages, the prefill half, the decode half).

Internal endpoints (not for clients), bodies in disagg/messages.py:
- decode  POST /internal/generate  GenerateCall -> NDJSON lines of RequestOutput
- prefill POST /internal/prefill   PrefillCall  -> PrefillDone
- prefill POST /internal/generate  GenerateCall -> NDJSON lines (a whole request the router lends
  to an idle prefill worker; prefilled and decoded there)
Each checks its request once (pydantic, then engine.check_request): the one validation of this
process. Both need the internal secret (server/guards.py), and neither takes an address
to connect to from a request body on trust: a prefill worker sends K/V only to the address of
the decode worker that called it, and a decode worker calls only prefill workers it knows
(its --prefill-urls, or the addresses of its --prefill-service).

Version coherence (a rollout runs two revisions side by side): each worker reports its --revision
in /internal/state, the router pairs a decode worker only with prefill workers of its revision
(server/routing.py), a prefill worker refuses a call from a decode worker of another revision
(409), and the KV handshake refuses a link between caches of different layouts (kv/handshake.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from phasesplit.runtime import internal_secret
from phasesplit.runtime.disagg import placement
from phasesplit.runtime.disagg.decode import DecodeConnector, KnownPrefill
from phasesplit.runtime.disagg.messages import GenerateCall, PrefillCall
from phasesplit.runtime.disagg.prefill import PrefillConnector
from phasesplit.runtime.kv import handshake
from phasesplit.runtime.kv.receiver import KVReceiver
from phasesplit.runtime.kv.sender import TransferFailed
from phasesplit.runtime.request import Overloaded, RequestError, RequestOutput
from phasesplit.runtime.server.admission import Admission, Ticket
from phasesplit.runtime.server.async_engine import AsyncEngine
from phasesplit.runtime.server.guards import Guards
from phasesplit.runtime.server.openai_api import add_common_routes, install_error_handlers
from phasesplit.runtime.server.protocol import error_body
from phasesplit.runtime.server.worker import add_debug_routes, build_engine, worker_admission

log = logging.getLogger(__name__)

KEEPALIVE_S = 2.0  # seconds between empty NDJSON lines while a request waits for its next output


def output_line(out: RequestOutput) -> bytes:
    return (json.dumps(out.to_dict()) + "\n").encode()


def stream_response(outputs: AsyncIterator[RequestOutput], on_end: Callable[[], None], ticket: Ticket
                    ) -> StreamingResponse:
    """/internal/generate's answer: a request's outputs as NDJSON lines, an empty line every
    KEEPALIVE_S while it waits (queued is not hung: the router's per-chunk read timeout is for
    workers that stop answering altogether), an error line if it fails. When the client leaves,
    the request is aborted (the generator's close reaches the engine, which frees its blocks);
    `on_end` then runs and the admission ticket goes back."""

    async def lines() -> AsyncIterator[bytes]:
        pending: asyncio.Future | None = None
        try:
            while True:
                pending = asyncio.ensure_future(anext(outputs))
                while not (await asyncio.wait({pending}, timeout=KEEPALIVE_S))[0]:
                    yield b"\n"
                try:
                    out = pending.result()
                except StopAsyncIteration:
                    break
                yield output_line(out)
        except Exception as e:  # noqa: BLE001 - the router turns this into an error event
            yield (json.dumps({"error": str(e)}) + "\n").encode()
        finally:
            if pending is not None and not pending.done():
                pending.cancel()  # the client left: the generator's abort runs
                with contextlib.suppress(BaseException):
                    await pending
            on_end()
            await outputs.aclose()
            ticket.release()

    body = lines()
    # A stream cut before its first chunk never runs lines()'s finally: give the slot back then.
    weakref.finalize(body, ticket.release)
    return StreamingResponse(body, media_type="application/x-ndjson")


def admit_call(engine, admission: Admission, call: GenerateCall) -> Ticket | JSONResponse:
    """Check a GenerateCall (the one validation of this process) and take its admission slot:
    the ticket, or the 400 / 429 answer to send instead (the router relays either to its client)."""
    try:
        engine.check_request(len(call.prompt_ids), call.params)
    except RequestError as e:
        return JSONResponse(error_body(str(e), param=e.param), status_code=400)
    try:
        return admission.admit(len(call.prompt_ids), call.params.num_seqs)
    except Overloaded as e:
        return JSONResponse(error_body(str(e), "requests", code="rate_limit_exceeded"), status_code=429,
                            headers={"Retry-After": str(e.retry_after)})


def kv_layout(engine) -> str:
    """This worker's K/V layout fingerprint: the model, dtype, block size and cache geometry."""
    r, c = engine.runner, engine.runner.cfg
    # The model's geometry, not this cache's: a tensor-parallel rank holds a share of the KV heads
    # but exchanges all of them, so TP and non-TP workers of one model interoperate.
    return handshake.fingerprint(engine.model_name, str(r.dtype).removeprefix("torch."), r.block_size,
                                 c.num_layers, c.num_kv_heads, c.head_dim)


def _worker_app(title: str, engine, metrics, aengine: AsyncEngine, secret: str, args: argparse.Namespace
                ) -> FastAPI:
    app = FastAPI(title=title, docs_url=None, redoc_url=None)
    # No client routes here: /internal/* and /debug/* need the internal secret.
    app.add_middleware(Guards, secret=secret, max_body=args.max_body_bytes,
                       internal_prefixes=("/internal/", "/debug/"))
    install_error_handlers(app)
    add_common_routes(app, metrics, ready=aengine.alive, alive=aengine.alive)
    add_debug_routes(app, engine)
    return app


def build_prefill_app(args: argparse.Namespace) -> FastAPI:
    secret = internal_secret.load()
    engine, metrics, name = build_engine(args, "prefill")
    layout = kv_layout(engine)
    connector = PrefillConnector(engine.runner, args.prefill_timeout, secret, layout)
    engine.connector = connector
    aengine = AsyncEngine(engine)
    app = _worker_app("phasesplit prefill worker", engine, metrics, aengine, secret, args)
    app.router.on_shutdown.append(aengine.shutdown)
    app.router.on_shutdown.append(connector.close)

    admission = worker_admission(args, engine)

    @app.get("/internal/state")
    async def state() -> dict[str, Any]:
        # takes_requests: this worker serves whole requests too (/internal/generate, below); a
        # router lends it one only where it says so (an older prefill worker has no such route).
        return {**engine.state(), "revision": args.revision, "kv_layout": layout, "takes_requests": True}

    @app.post("/internal/generate")
    async def generate(call: GenerateCall):
        """A whole request, prefilled and decoded here: the router lends an idle prefill worker's
        core to decoding (server/routing.py, lend_prefill). Remote prefills that arrive meanwhile
        share its steps at full size, as a colocated engine's prompts do (worker.engine_config)."""
        if call.prefill_urls:  # the router never sends them here: a prefill worker calls no other
            return JSONResponse(error_body("a prefill worker prefills the requests it serves itself",
                                           param="prefill_urls"), status_code=400)
        ticket = admit_call(engine, admission, call)
        if isinstance(ticket, JSONResponse):
            return ticket
        return stream_response(aengine.generate(call.request_id, call.prompt_ids, call.params),
                               on_end=lambda: None, ticket=ticket)

    @app.post("/internal/prefill")
    async def prefill(call: PrefillCall, request: Request) -> JSONResponse:
        caller = request.client.host if request.client else None
        if call.kv_host != caller:  # K/V goes back to the caller, never to an address in a body
            return JSONResponse(error_body(f"kv_host {call.kv_host!r} is not the caller's address {caller!r}",
                                           param="kv_host"), status_code=403)
        if call.revision != args.revision:  # a pairing the router never makes; a stale or foreign caller
            return JSONResponse(error_body(f"revision mismatch: this prefill worker is revision {args.revision!r}, "
                                           f"the decode worker {call.revision!r}", param="revision"),
                                status_code=409)
        try:
            engine.check_request(len(call.prompt_ids), call.params)
        except RequestError as e:
            return JSONResponse(error_body(str(e), param=e.param), status_code=400)
        try:
            done = await connector.prefill(aengine, call)
        except (TransferFailed, RuntimeError) as e:
            metrics.child(metrics.kv_failures).inc()
            return JSONResponse(error_body(str(e), "server_error"), status_code=502)
        metrics.child(metrics.kv_bytes).inc(done.bytes)
        metrics.child(metrics.kv_transfer).observe(done.seconds)
        return JSONResponse(done.model_dump())

    return app


def build_decode_app(args: argparse.Namespace) -> FastAPI:
    secret = internal_secret.load()
    engine, metrics, name = build_engine(args, "decode")
    kv_host = args.kv_host or args.host
    layout = kv_layout(engine)
    receiver = KVReceiver(args.host if args.host != "0.0.0.0" else "", args.kv_port, engine.runner.kv_cache,
                          secret, vocab_size=engine.runner.cfg.vocab_size, layout=layout)
    aengine = AsyncEngine(engine)
    connector = DecodeConnector(aengine, receiver, metrics, kv_host=kv_host, prefill_urls=list(args.prefill_urls),
                                policy=args.on_prefill_failure, timeout=args.prefill_timeout,
                                local_threshold=args.local_prefill_threshold, secret=secret,
                                revision=args.revision, placement_mode=args.prefill_placement,
                                itl_target=args.itl_target or None)
    engine.connector = connector
    known = KnownPrefill(list(args.prefill_urls), args.prefill_service)
    app = _worker_app("phasesplit decode worker", engine, metrics, aengine, secret, args)
    admission = worker_admission(args, engine)

    @app.on_event("startup")
    async def _bind_loop() -> None:
        connector.loop = asyncio.get_running_loop()
        log.info("KV receiver on port %d (advertised as %s)", receiver.port, kv_host)

    @app.on_event("shutdown")
    async def _stop() -> None:
        receiver.close()
        aengine.shutdown()

    @app.get("/internal/state")
    async def state() -> dict[str, Any]:
        return {**engine.state(), "kv_port": receiver.port, "kv_rejected": receiver.rejected,
                "kv_refused": receiver.refused, "kv_mismatched": receiver.mismatched,
                "kv_connections": receiver.connections, "revision": args.revision, "kv_layout": layout,
                # How near its ITL target a step with one more stream would run (routing.lend_prefill).
                "next_step_s": engine.next_decode_step_s(), "itl_target_s": engine.config.itl_target_s,
                "placement_costs": dict(zip(("local_base_s", "local_per_token_s", "remote_base_s",
                                             "remote_per_token_s"), connector.costs(), strict=True))}

    @app.post("/internal/generate")
    async def generate(call: GenerateCall, request: Request):
        # The router's ranking, restricted to prefill workers this worker knows. Before the slot
        # is taken: nothing between admission and the stream may wait.
        urls = await known.filter(call.prefill_urls) or list(args.prefill_urls)
        ticket = admit_call(engine, admission, call)
        if isinstance(ticket, JSONResponse):
            return ticket
        if urls:
            connector.route(call.request_id, urls, call.prefill_queued_tokens)
        else:
            metrics.place(placement.LOCAL, placement.NO_PREFILL_WORKER)

        return stream_response(aengine.generate(call.request_id, call.prompt_ids, call.params, remote=bool(urls)),
                               on_end=lambda: connector.forget(call.request_id), ticket=ticket)

    return app
