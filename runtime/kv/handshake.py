"""The KV port's connection handshake: both ends prove they hold the internal secret.

    receiver → sender   "PSKA" | nonce_r (16 bytes)
    sender   → receiver nonce_s (16) | HMAC(secret, "sender", nonce_r, nonce_s) (32)
    receiver → sender   HMAC(secret, "receiver", nonce_s, nonce_r) (32)

The receiver reads nothing else from a connection (and allocates nothing for it) until the
sender's proof checks out, so an unauthenticated peer can send no frame. The sender checks the
receiver's proof before it sends any K/V, so a KV address it was handed cannot be a sink that
does not hold the secret. The secret itself never crosses the wire.
"""

from __future__ import annotations

import hmac
import os
import socket

from phasesplit.runtime import internal_secret

HELLO = b"PSKA"
NONCE = 16
PROOF = 32


class HandshakeError(ConnectionError):
    pass


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


def accept(sock: socket.socket, secret: str) -> None:
    """Receiver side: challenge the peer; raises HandshakeError unless it proves the secret.
    The caller sets the socket's receive timeout (the handshake must not wait for long)."""
    nonce_r = os.urandom(NONCE)
    sock.sendall(HELLO + nonce_r)
    answer = _recv_exact(sock, NONCE + PROOF)
    nonce_s, got = answer[:NONCE], answer[NONCE:]
    if not hmac.compare_digest(got, internal_secret.proof(secret, b"sender", nonce_r, nonce_s)):
        raise HandshakeError("peer failed the internal-secret challenge")
    sock.sendall(internal_secret.proof(secret, b"receiver", nonce_s, nonce_r))


def connect(sock: socket.socket, secret: str) -> None:
    """Sender side: answer the challenge and check the receiver's proof."""
    hello = _recv_exact(sock, len(HELLO) + NONCE)
    if hello[: len(HELLO)] != HELLO:
        raise HandshakeError("not a phasesplit KV port")
    nonce_r, nonce_s = hello[len(HELLO):], os.urandom(NONCE)
    sock.sendall(nonce_s + internal_secret.proof(secret, b"sender", nonce_r, nonce_s))
    if not hmac.compare_digest(_recv_exact(sock, PROOF), internal_secret.proof(secret, b"receiver", nonce_s, nonce_r)):
        raise HandshakeError("the KV receiver failed the internal-secret challenge")
