"""Decode side of the KV transfer: a TCP server that writes incoming layers into reserved blocks.

Only transfers the decode worker announced (`expect`) are accepted, only into the slots it
reserved for them, only with the cache's own dtype and shape, and per layer strictly in token
order. Anything else closes the connection and fails that transfer; it never touches another
request's blocks. A cancelled transfer (timeout, abort) is forgotten under the same lock that
guards writes, so a late frame cannot land in blocks that were handed to someone else.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from phasesplit.runtime.kv.wire import (
    ACK,
    CODE_DTYPES,
    DATA,
    DONE,
    HEADER_SIZE,
    NACK,
    FrameError,
    Header,
    payload_tensor,
)
from phasesplit.runtime.model.attention import write_rows

log = logging.getLogger(__name__)


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first position, first slot, length) of each run of consecutive slots."""
    if len(slots) == 0:
        return []
    s = slots.numpy()
    breaks = (np.nonzero(np.diff(s) != 1)[0] + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, len(s)]
    return [(a, int(s[a]), b - a) for a, b in zip(starts, ends, strict=True)]


@dataclass
class Expected:
    slots: torch.Tensor  # cache slot of every prompt position
    skip: int  # positions below this are already cached here and are not sent
    on_done: Callable[[int, int, float], None]  # (first_token, bytes, seconds)
    on_fail: Callable[[str], None]
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # slot_runs(slots)
    filled: list[int] = field(default_factory=list)  # per layer: next expected position
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)


class KVReceiver:
    def __init__(self, host: str, port: int, kv_cache: torch.Tensor,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.kv_cache = kv_cache  # [2, layers, slots, kv_heads, head_dim]
        self.layers, self.heads, self.dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
        self.on_bytes = on_bytes or (lambda n: None)
        self.lock = threading.Lock()
        self.transfers: dict[int, Expected] = {}
        self.rejected = 0
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="kv-accept", daemon=True).start()

    def expect(self, transfer_id: int, slots: torch.Tensor, skip: int,
               on_done: Callable[[int, int, float], None], on_fail: Callable[[str], None]) -> None:
        with self.lock:
            slots = slots.cpu()
            self.transfers[transfer_id] = Expected(slots, skip, on_done, on_fail, slot_runs(slots),
                                                   [skip] * self.layers)

    def cancel(self, transfer_id: int) -> None:
        with self.lock:
            self.transfers.pop(transfer_id, None)

    def close(self) -> None:
        self._closed = True
        self.sock.close()

    # -- network threads -----------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        tid = None
        buf = bytearray()  # reused across this connection's frames: no allocation per layer
        try:
            with conn:
                while True:
                    raw = _recv_exact(conn, HEADER_SIZE)
                    if raw is None:
                        return  # clean close between frames
                    h = Header.unpack(raw)
                    tid = h.transfer_id
                    if h.kind == DATA:
                        if len(buf) < h.payload_len:
                            buf = bytearray(h.payload_len)
                        self._data(conn, h, memoryview(buf)[: h.payload_len])
                    elif h.kind == DONE:
                        ok = self._done(h)
                        conn.sendall(Header(ACK if ok else NACK, h.transfer_id).pack())
                    else:
                        raise FrameError(f"unexpected frame kind {h.kind} from a sender")
        except (FrameError, ConnectionError, OSError) as e:
            self.rejected += 1
            log.warning("KV frame from %s rejected: %s", peer, e)
            if tid is not None:
                self._fail(tid, f"KV transfer from {peer} failed: {e}")

    def _data(self, conn: socket.socket, h: Header, payload: memoryview) -> None:
        with self.lock:
            exp = self.transfers.get(h.transfer_id)
        if exp is None:
            raise FrameError(f"unknown or cancelled transfer {h.transfer_id}")
        if h.layer >= self.layers or h.kv_heads != self.heads or h.head_dim != self.dim:
            raise FrameError(f"layer {h.layer} / shape [{h.kv_heads},{h.head_dim}] does not fit this cache")
        if CODE_DTYPES[h.dtype] != self.kv_cache.dtype:
            raise FrameError(f"dtype {CODE_DTYPES[h.dtype]} differs from this cache's {self.kv_cache.dtype}")
        end = h.token_start + h.num_tokens
        if h.token_start != exp.filled[h.layer] or end > len(exp.slots):
            raise FrameError(f"layer {h.layer} tokens [{h.token_start},{end}) out of order or past the "
                             f"reservation (expected start {exp.filled[h.layer]}, {len(exp.slots)} tokens)")
        if not _recv_into(conn, payload):
            raise FrameError(f"truncated payload ({h.payload_len} bytes announced)")
        kv = payload_tensor(h, payload).to(self.kv_cache.device, non_blocking=True)
        # Blocks are mostly handed out in order, so a frame usually lands in a few runs of
        # consecutive slots: plain slice copies then beat a scatter by about 10x.
        runs = [(max(p, h.token_start), s + max(p, h.token_start) - p, min(p + n, end) - max(p, h.token_start))
                for p, s, n in exp.runs if p < end and p + n > h.token_start]
        with self.lock:
            if self.transfers.get(h.transfer_id) is not exp:
                raise FrameError(f"transfer {h.transfer_id} was cancelled mid-frame")
            layer = self.kv_cache[:, h.layer]
            if len(runs) <= 8:
                for pos, slot, n in runs:  # K and V apart: one strided bf16 copy_ is ~15x slower
                    off = pos - h.token_start
                    layer[0, slot : slot + n].copy_(kv[0, off : off + n])
                    layer[1, slot : slot + n].copy_(kv[1, off : off + n])
            else:
                idx = exp.slots[h.token_start:end].to(self.kv_cache.device)
                write_rows(layer[0], idx, kv[0])
                write_rows(layer[1], idx, kv[1])
            exp.filled[h.layer] = end
            exp.bytes += h.payload_len
        self.on_bytes(h.payload_len)

    def _done(self, h: Header) -> bool:
        with self.lock:
            exp = self.transfers.pop(h.transfer_id, None)
        if exp is None:
            return False
        missing = [i for i, f in enumerate(exp.filled) if f != len(exp.slots)]
        if missing:
            exp.on_fail(f"transfer ended with layers {missing[:5]} incomplete")
            return False
        exp.on_done(h.value, exp.bytes, time.monotonic() - exp.started)
        return True

    def _fail(self, tid: int, why: str) -> None:
        with self.lock:
            exp = self.transfers.pop(tid, None)
        if exp is not None:
            exp.on_fail(why)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise FrameError(f"connection closed inside a header ({got} of {n} bytes)")
        got += k
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < view.nbytes:
        k = conn.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True
