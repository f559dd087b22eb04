"""The internal secret: what prefill, decode and router workers of one service share, and how a
peer proves it holds it. Torch-free (the router imports it).

HTTP: internal calls (/internal/*) carry the secret in one header, checked in constant time
before the body is read (server/guards.py). KV port: the secret itself never crosses the
wire; each connection starts with a mutual challenge (kv/handshake.py) whose answers are
HMAC-SHA256 proofs computed here.

The operator creates one Secret per InferenceService and hands it to its pods in
PHASESPLIT_INTERNAL_SECRET; `phasesplit up` makes a random one for its children.
"""

from __future__ import annotations

import hashlib
import hmac
import os

ENV = "PHASESPLIT_INTERNAL_SECRET"
HEADER = "X-Phasesplit-Internal"
MIN_LENGTH = 16  # characters; a shorter secret is a configuration mistake, not a secret


class SecretError(ValueError):
    """No usable internal secret (the worker refuses to start)."""


def load(environ: dict[str, str] | None = None) -> str:
    """The internal secret from the environment; raises SecretError naming the variable."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not value:
        raise SecretError(f"{ENV} is not set: split-mode workers and the router authenticate each other with "
                          "it (the operator and `phasesplit up` set it; set the same random value on every "
                          "worker of one service)")
    if len(value) < MIN_LENGTH:
        raise SecretError(f"{ENV} is shorter than {MIN_LENGTH} characters")
    return value


def headers(secret: str) -> dict[str, str]:
    """What a client of another worker's /internal/* sends."""
    return {HEADER: secret}


def matches(secret: str, presented: str | None) -> bool:
    """Constant-time comparison of a presented secret with ours."""
    return presented is not None and hmac.compare_digest(secret.encode(), presented.encode())


def proof(secret: str, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over a role label and the challenge nonces: a proof of the secret that is worth
    nothing on another connection (fresh nonces) or in the other direction (the label)."""
    mac = hmac.new(secret.encode(), label, hashlib.sha256)
    for p in parts:
        mac.update(p)
    return mac.digest()
