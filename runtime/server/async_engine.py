"""Drives an LLMEngine from one background thread and hands results to asyncio tasks.

Torch releases the GIL inside its kernels, so the event loop keeps serving HTTP while a step
runs. Every engine mutation happens on the engine thread: requests and aborts arrive through
an inbox, which keeps the engine itself free of locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from phasesplit.runtime.engine.engine import LLMEngine
from phasesplit.runtime.request import RequestOutput, SamplingParams
from phasesplit.runtime.server.admission import Admission, Ticket

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


class GenerationFailed(RuntimeError):
    """The request ended with an error (e.g. its remote prefill failed under the `fail` policy)."""


# Steps that fail one after another before the engine is declared dead: a fault that a request
# brought in goes with the requests it fails; one that stays (the device) ends the process.
MAX_FAILED_STEPS = 3


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # -- called from the event loop ------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       **options: Any) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (checked already: engine.check_request at the process's
        edge). Leaving the iterator early aborts the request."""
        if self.error is not None:
            raise EngineDead(f"engine failed: {self.error}")
        q: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = (asyncio.get_running_loop(), q)
        # Stamped here: the engine takes it in between steps, and that wait is part of its queueing.
        self.inbox.put(("add", (request_id, prompt_ids, params, {**options, "arrival": time.monotonic()})))
        finished = False
        # Every choice of an n > 1 request ends on its own; a prefill worker runs only the first.
        pending = 1 if options.get("prefill_only") else params.num_seqs
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    finished = True
                    raise GenerationFailed(item.error)
                yield item
                if item.finished:
                    pending -= 1
                    if pending == 0:
                        finished = True
                        return
        finally:
            self.streams.pop(request_id, None)
            if not finished:
                self.inbox.put(("abort", request_id))

    def alive(self) -> tuple[bool, str]:
        """For /health: False once the engine thread has stopped serving."""
        if self.error is not None:
            return False, f"engine failed: {self.error}"
        if not self._thread.is_alive() and not self._stop.is_set():
            return False, "engine thread exited"
        return True, "ok"

    def call(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn(engine) on the engine thread (the remote-prefill protocol's results)."""
        self.inbox.put(("call", fn))

    def shutdown(self) -> None:
        self._stop.set()
        self.inbox.put(("stop", None))
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # a step still running keeps the ranks; the process exit ends them
            self.engine.close()

    # -- engine thread ---------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self.streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _handle(self, kind: str, payload: Any) -> None:
        e = self.engine
        if kind == "add":
            request_id, prompt_ids, params, options = payload
            if request_id not in self.streams:  # the client left before the engine saw it
                return
            try:
                e.add_request(request_id, prompt_ids, params, **options)
            except Exception as exc:  # a request error must reach its caller, not kill the engine
                self._deliver(request_id, exc)
        elif kind == "abort":
            e.abort(payload)
        elif kind == "call":
            try:
                payload(e)
            except Exception:  # noqa: BLE001 - a protocol callback's bug must not stop the engine
                log.exception("engine callback failed")

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every request the engine holds (one of them brought the fault in); keep serving."""
        for rid in list(self.engine.seqs):
            try:
                self.engine.fail(rid, f"generation failed: {exc}")
            except Exception:  # noqa: BLE001
                log.exception("cannot fail request %s", rid)
        self._send_pending()

    def _send_pending(self) -> None:
        """Send what the engine made outside a step (failures, a remote prefill's first token)."""
        for out in self.engine.take_outputs():
            self._deliver(out.request_id, out)

    def _run(self) -> None:
        e = self.engine
        failed_steps = 0
        while not self._stop.is_set():
            try:
                # A split decode worker may leave its CPU to the prefill worker computing a prompt
                # for it (LLMEngine.remote_pause): it waits here, woken by the K/V's arrival.
                kind, payload = self.inbox.get(timeout=e.remote_pause() if e.has_work() else None)
            except queue.Empty:
                kind = None
            try:
                while kind is not None:
                    if kind == "stop":
                        return
                    self._handle(kind, payload)
                    try:
                        kind, payload = self.inbox.get_nowait()
                    except queue.Empty:
                        kind = None
                # A remote prefill's first token (a call above) goes out now, not after the step
                # that computes the second: on the split TTFT path, that step was one ITL.
                self._send_pending()
                if e.has_work() and not e.remote_pause():
                    for out in e.step():
                        self._deliver(out.request_id, out)
                failed_steps = 0
            except Exception as exc:  # noqa: BLE001 - fail what it held; stop if it keeps failing
                failed_steps += 1
                log.exception("engine step failed (%d in a row); failing the %d requests it held",
                              failed_steps, len(e.seqs))
                if failed_steps < MAX_FAILED_STEPS:
                    self._fail_all(exc)
                    continue
                log.error("engine stopped after %d failed steps: %s; /health now fails", failed_steps, exc)
                self.error = exc
                for rid in list(self.streams):
                    self._deliver(rid, EngineDead(f"engine failed: {exc}"))
                return


class LocalBackend:
    """The OpenAI API's backend in colocated mode: the engine in this process."""

    def __init__(self, aengine: AsyncEngine, admission: Admission) -> None:
        self.aengine = aengine
        self.admission = admission
        self.tokenizer = aengine.engine.tokenizer
        self.max_model_len = aengine.engine.max_model_len

    def check_request(self, prompt_len: int, params: SamplingParams) -> None:
        self.aengine.engine.check_request(prompt_len, params)

    def admit(self, prompt_tokens: int, seqs: int = 1) -> Ticket:
        return self.admission.admit(prompt_tokens, seqs)

    def capacity(self) -> int:
        return self.admission.max_requests

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                 ) -> AsyncIterator[RequestOutput]:
        return self.aengine.generate(request_id, prompt_ids, params)
