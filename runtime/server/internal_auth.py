"""Internal HTTP calls (/internal/*) need the internal secret: an ASGI middleware that checks the
header before anything of the request (its body included) is read, in constant time."""

from __future__ import annotations

import json
from typing import Any

from phasesplit.runtime import internal_secret
from phasesplit.runtime.server.protocol import error_body

_HEADER = internal_secret.HEADER.lower().encode()
PREFIX = "/internal/"


def headers(secret: str) -> dict[str, str]:
    """What a client of another worker's /internal/* sends."""
    return {internal_secret.HEADER: secret}


class InternalAuth:
    def __init__(self, app: Any, secret: str) -> None:
        self.app, self.secret = app, secret

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            presented = next((v.decode("latin-1") for k, v in scope["headers"] if k == _HEADER), None)
            if not internal_secret.matches(self.secret, presented):
                body = json.dumps(error_body(f"internal endpoint: missing or wrong {internal_secret.HEADER} "
                                             "header", "authentication_error", code="invalid_api_key")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
