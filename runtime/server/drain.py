"""Drain, never cut: on SIGTERM a server turns not-ready at once, refuses new work with 503,
lets what it holds finish (streams, prefills and their KV sends) up to a drain timeout, then exits.

In a pod the preStop delay runs first, while the endpoint is already marked terminating, so the
router and the Service stop sending before SIGTERM arrives; the 503 and the not-ready answers
cover whatever still arrives. A second signal stops at once.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from phasesplit.runtime.server.protocol import error_body

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 300.0  # seconds: a long generation (thousands of tokens) finishes within it
# Not work: probes, scrapes and the router's polls never hold a drain open (and still answer).
QUIET_PATHS = frozenset({"/health", "/metrics", "/debug/state", "/internal/workers"})
# Answer 503 while draining, so probes and the router's polls see a worker going away.
NOT_READY_PATHS = frozenset({"/ready", "/internal/state"})


@dataclass
class Drain:
    """A server's drain state. Pure: the caller passes the clock."""

    timeout: float = DEFAULT_TIMEOUT
    started: float | None = None  # when the drain began (monotonic seconds)
    inflight: int = 0  # requests being served now (streams count until their last byte)

    @property
    def active(self) -> bool:
        return self.started is not None

    def begin(self, now: float) -> None:
        if self.started is None:
            self.started = now

    def finished(self, now: float) -> bool:
        """Draining and either idle or out of time."""
        return self.started is not None and (self.inflight == 0 or now - self.started >= self.timeout)


class DrainMiddleware:
    """Counts requests in flight; while draining, refuses new ones and reports not-ready."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.active:
            if path in NOT_READY_PATHS:
                body = {"ready": False, "reason": "draining", "draining": True}
            else:
                body = error_body("this server is shutting down; retry on another replica",
                                  "server_error", code="draining")
            raw = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"connection", b"close"), (b"content-length", str(len(raw)).encode())]})
            await send({"type": "http.response.body", "body": raw})
            return
        if path in NOT_READY_PATHS:
            await self.app(scope, receive, send)
            return
        self.drain.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.inflight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn, with the first SIGTERM/SIGINT starting a drain instead of the shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.active:  # a second signal: stop now
            log.warning("%s during the drain: stopping with %d requests in flight",
                        signal.Signals(sig).name, self.drain.inflight)
            self.should_exit = self.force_exit = True
            return
        self.drain.begin(time.monotonic())
        log.info("%s: draining %d requests in flight (up to %gs); not ready, refusing new requests",
                 signal.Signals(sig).name, self.drain.inflight, self.drain.timeout)

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.drain.finished(time.monotonic()):
            left = self.drain.inflight
            if left:
                log.warning("drain timeout: stopping with %d requests in flight", left)
            else:
                log.info("drained: stopping")
            self.should_exit = True
        return await super().on_tick(counter)


def run(app: Any, host: str, port: int, drain: Drain) -> None:
    app.add_middleware(DrainMiddleware, drain=drain)
    # The drain has waited for the work; what is left at shutdown is idle keep-alive connections.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    DrainingServer(config, drain).run()
