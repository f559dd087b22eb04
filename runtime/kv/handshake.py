"""The KV port's connection handshake: both ends prove they hold the internal secret, and both
check that they share one K/V layout.

    receiver → sender   "PSK2" | nonce_r (16 bytes) | len u8 | fingerprint_r
    sender   → receiver nonce_s (16) | len u8 | fingerprint_s | HMAC(secret, "sender", nonce_r, nonce_s, fp_s) (32)
    receiver → sender   HMAC(secret, "receiver", nonce_s, nonce_r, fp_r) (32)

The receiver reads nothing else from a connection (and allocates nothing for it) until the
sender's proof checks out, so an unauthenticated peer can send no frame. The sender checks the
receiver's proof before it sends any K/V, so a KV address it was handed cannot be a sink that
does not hold the secret. The secret itself never crosses the wire.

The fingerprint (`fingerprint`: model, dtype, block size, layers x KV heads x head dim) says what
the K/V on this link means. Frames carry their dtype and shape, but not which model computed them:
a prefill worker of another model with the same geometry (a fine-tune, another revision mid-rollout)
would fill the cache with K/V the decode worker then silently decodes into garbage. So both ends
compare: the sender refuses to send into a cache of another layout, and the receiver refuses the
connection, each naming both fingerprints. Version 2 of the handshake ("PSK2"): a worker that
speaks version 1 ("PSKA") is refused by name as well.
"""

from __future__ import annotations

import hmac
import os
import socket

from phasesplit.runtime import internal_secret

HELLO = b"PSK2"
OLD_HELLO = b"PSKA"  # version 1, before the layout fingerprint
NONCE = 16
PROOF = 32
MAX_FINGERPRINT = 255  # one length byte: bounds what the receiver reads before the proof


class HandshakeError(ConnectionError):
    pass


class LayoutMismatch(HandshakeError):
    """The two ends would not read K/V the same way (another model, dtype, block size or geometry)."""


def fingerprint(model: str, dtype: str, block_size: int, layers: int, kv_heads: int, head_dim: int) -> str:
    """What K/V on a link means, readable in an error message: model id, dtype, block size and the
    cache's geometry (layers x KV heads x head dim)."""
    fp = f"{model}/{dtype}/block{block_size}/{layers}x{kv_heads}x{head_dim}"
    return fp.encode()[:MAX_FINGERPRINT].decode(errors="ignore")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except (BlockingIOError, TimeoutError):
            raise HandshakeError("handshake timed out") from None
        if not chunk:
            raise HandshakeError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


def _pack(fp: str) -> bytes:
    raw = fp.encode()
    if len(raw) > MAX_FINGERPRINT:
        raise ValueError(f"KV layout fingerprint longer than {MAX_FINGERPRINT} bytes: {fp!r}")
    return bytes([len(raw)]) + raw


def _recv_fingerprint(sock: socket.socket) -> bytes:
    return _recv_exact(sock, _recv_exact(sock, 1)[0])


def accept(sock: socket.socket, secret: str, layout: str) -> None:
    """Receiver side: challenge the peer; raises HandshakeError unless it proves the secret, and
    LayoutMismatch (naming both) unless it produces K/V of this receiver's `layout`.
    The caller sets the socket's receive timeout (the handshake must not wait for long)."""
    nonce_r = os.urandom(NONCE)
    sock.sendall(HELLO + nonce_r + _pack(layout))
    nonce_s = _recv_exact(sock, NONCE)
    fp_s = _recv_fingerprint(sock)
    got = _recv_exact(sock, PROOF)
    if not hmac.compare_digest(got, internal_secret.proof(secret, b"sender", nonce_r, nonce_s, fp_s)):
        raise HandshakeError("peer failed the internal-secret challenge")
    if fp_s != layout.encode():
        raise LayoutMismatch(f"KV layout mismatch: this decode worker's cache holds {layout!r}, the prefill "
                             f"worker would send {fp_s.decode(errors='replace')!r}")
    sock.sendall(internal_secret.proof(secret, b"receiver", nonce_s, nonce_r, layout.encode()))


def connect(sock: socket.socket, secret: str, layout: str) -> None:
    """Sender side: answer the challenge, refuse a receiver of another layout (LayoutMismatch,
    naming both), check the receiver's proof."""
    hello = _recv_exact(sock, len(HELLO) + NONCE)
    if hello[: len(HELLO)] == OLD_HELLO:
        raise HandshakeError("the KV receiver speaks handshake version 1 (no layout fingerprint): "
                             "a decode worker of an older release")
    if hello[: len(HELLO)] != HELLO:
        raise HandshakeError("not a phasesplit KV port")
    fp_r = _recv_fingerprint(sock)
    nonce_r, nonce_s = hello[len(HELLO):], os.urandom(NONCE)
    mine = layout.encode()
    # Answered even on a mismatch, so that the receiver sees (and logs) the refusal too.
    sock.sendall(nonce_s + _pack(layout) + internal_secret.proof(secret, b"sender", nonce_r, nonce_s, mine))
    if fp_r != mine:
        raise LayoutMismatch(f"KV layout mismatch: the decode worker's cache holds {fp_r.decode(errors='replace')!r}, "
                             f"this prefill worker computes {layout!r}; refusing to send")
    if not hmac.compare_digest(_recv_exact(sock, PROOF),
                               internal_secret.proof(secret, b"receiver", nonce_s, nonce_r, fp_r)):
        raise HandshakeError("the KV receiver failed the internal-secret challenge")
