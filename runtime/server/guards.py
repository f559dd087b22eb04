"""The one ASGI middleware that runs before a request's body is read: who may call a route, how
big a body may be, and whether there is room for another generation at all.

- client routes (`/v1/*`, `/debug/*`, `/tokenize`, `/detokenize`, `/tokenizer_info`) need the
  API key when one is set (`Authorization: Bearer <key>`);
- internal routes (`/internal/*`, and on split workers `/debug/*` too) need the internal secret
  (runtime/internal_secret.py's header), always;
- probes and scrapes (`/health`, `/ready`, `/metrics`) need nothing;
- a body over `max_body` bytes gets 413, by its Content-Length or, chunked, as it arrives;
- with `capacity` given, a generation request (`/v1/completions`, `/v1/chat/completions`) that
  finds twice as many generation requests in the process as it could admit gets 429 at once (the
  margin: requests that turn out invalid are refused with 400 only once parsed, and must not
  crowd out valid ones).
  Refusing there, before the body is parsed and the prompt tokenized, is what keeps overload
  cheap: a burst of clients beyond capacity costs the event loop almost nothing, so the admitted
  requests are not slowed (or their worker connections timed out) by the ones refused. The exact
  admission (sequences and tokens, server/admission.py) follows once the prompt is known.

Keys are compared in constant time. Answers are in OpenAI's error shape, 401 `invalid_api_key`.
Raw ASGI (not FastAPI dependencies) so that a refused request costs no parsing at all.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from phasesplit.runtime import internal_secret
from phasesplit.runtime.server.protocol import error_body

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes: a full-context prompt as JSON token ids fits many times
CLIENT_PREFIXES = ("/v1/", "/debug/")
CLIENT_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
INTERNAL_PREFIXES = ("/internal/",)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RETRY_AFTER = 1  # seconds, in every 429's Retry-After
GATE_FACTOR = 2  # generation requests let past the gate, per request the process could admit
_INTERNAL_HEADER = internal_secret.HEADER.lower().encode()


async def _reply(send: Callable[[dict], Awaitable[None]], status: int, body: dict[str, Any],
                 headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


def check_api_key(api_key: str | None) -> None:
    """Refuse a key that is set but empty (checked when the app is built: Starlette builds
    middleware lazily, at the first request)."""
    if api_key is not None and not api_key:
        raise ValueError("the API key variable is set but empty: set a key, or unset it to serve without one")


class Guards:
    """api_key: what clients send on client routes (None: no key). secret: the internal secret
    (None: this process serves no internal routes, so every internal path is refused).
    internal_prefixes: the paths that need the secret (split workers add `/debug/`). capacity:
    how many generation requests the process could admit now (None: no gate)."""

    def __init__(self, app: ASGIApp, api_key: str | None = None, secret: str | None = None,
                 max_body: int = DEFAULT_MAX_BODY, internal_prefixes: tuple[str, ...] = INTERNAL_PREFIXES,
                 capacity: Callable[[], int] | None = None) -> None:
        check_api_key(api_key)
        self.app, self.secret, self.max_body, self.internal_prefixes = app, secret, max_body, internal_prefixes
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.capacity = capacity
        self.generating = 0  # generation requests between this gate and their response's end

    def _too_large(self) -> dict[str, Any]:
        return error_body(f"the request body is larger than {self.max_body} bytes", code="request_too_large")

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> str | None:
        """Why the caller may not call this path, or None."""
        if path.startswith(self.internal_prefixes):
            presented = headers.get(_INTERNAL_HEADER)
            if self.secret is None or not internal_secret.matches(
                    self.secret, presented.decode("latin-1") if presented is not None else None):
                return f"internal endpoint: missing or wrong {internal_secret.HEADER} header"
            return None
        if self.expected is not None and (path.startswith(CLIENT_PREFIXES) or path in CLIENT_PATHS):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return "missing or wrong API key (send 'Authorization: Bearer <key>')"
        return None

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        why = self._refusal(scope["path"], headers)
        if why is not None:
            return await _reply(send, 401, error_body(why, "authentication_error", code="invalid_api_key"))
        try:
            if int(headers.get(b"content-length", b"0")) > self.max_body:
                return await _reply(send, 413, self._too_large())
        except ValueError:
            return await _reply(send, 400, error_body("invalid Content-Length header"))
        if self.capacity is not None and scope["path"] in GENERATION_PATHS and scope["method"] == "POST":
            if self.generating >= GATE_FACTOR * max(1, self.capacity()):
                return await _reply(send, 429, error_body(
                    f"the server is at capacity ({self.generating} requests in flight); retry later", "requests",
                    code="rate_limit_exceeded"), [(b"retry-after", str(RETRY_AFTER).encode())])
            self.generating += 1
            try:
                return await self._guarded(scope, receive, send)
            finally:
                self.generating -= 1
        return await self._guarded(scope, receive, send)

    async def _guarded(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        """The app, with the body counted against the size limit as it arrives."""
        seen = 0
        replied = False

        async def limited_receive() -> dict:
            # A chunked body carries no Content-Length: count it as it arrives, answer 413 once it
            # passes the limit, and tell the app the client left (its own reply is dropped).
            nonlocal seen, replied
            message = await receive()
            if message["type"] == "http.request" and not replied:
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    replied = True
                    await _reply(send, 413, self._too_large())
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not replied:
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not replied:  # the app's own failure: not ours to hide
                raise
