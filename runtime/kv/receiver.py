"""Decode side of the KV transfer: a TCP server that writes incoming layers into reserved blocks.

Only transfers the decode worker announced (`expect`) are accepted, only into the slots it
reserved for them, only with the cache's own dtype and shape, and per layer strictly in token
order. Anything else closes the connection and fails that transfer; it never touches another
request's blocks.

On a CPU cache a frame's payload is received straight into the reserved cache rows (one
`recv_into` per run of consecutive slots, K and V apart): no staging buffer and no second copy.
That means bytes land in the slots while the frame is in flight, so a transfer cancelled
mid-frame (timeout, client gone) cannot hand its blocks back at once: `cancel` reports them busy
and the caller frees them when `on_released` fires, after the frame's last byte. The frame is
not cut short: a connection carries every transfer from one prefill worker, and the others on
it must go on. A stalled frame ends after STALL_TIMEOUT. Later frames of a cancelled transfer are
read and dropped. A truncated frame leaves garbage only in its own transfer's slots, and that
transfer fails.

A tensor-parallel decode worker's cache holds only its rank's KV heads, while frames carry every
head (whatever the prefill worker's TP size): its transfers land in a per-transfer CPU buffer
(`expect(..., landing=)`), contiguous per layer, which the decode side scatters to the ranks by
head once the transfer is done (ModelRunner.write_kv).

Hostile peers: a connection must first pass the internal-secret handshake (kv/handshake.py)
within HANDSHAKE_TIMEOUT, before any frame is read, and its sender must compute K/V of this
cache's layout (the handshake's fingerprint: another model or block size is refused there, by
name, where frame checks could not tell); at most `max_connections` are open at once
(more are closed on accept); a link idle for `idle_timeout` between frames is closed (the sender
reconnects quietly). A frame's header, its transfer and its place in the reservation are checked
before any byte of its payload is read or any buffer is allocated for it, and the DONE frame's
first token must be inside the vocabulary.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from phasesplit.runtime.kv import handshake
from phasesplit.runtime.kv.wire import (
    ACK,
    CODE_DTYPES,
    DATA,
    DONE,
    HEADER_SIZE,
    NACK,
    FrameError,
    Header,
    done_phases,
    payload_tensor,
)
from phasesplit.runtime.model.attention import write_rows

log = logging.getLogger(__name__)

STALL_TIMEOUT = 10.0  # seconds a frame's payload may stop arriving before the frame is failed
HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to prove the internal secret
IDLE_TIMEOUT = 300.0  # seconds an authenticated link may sit between frames
MAX_CONNECTIONS = 64  # open at once: a prefill worker needs one per decode worker
_RETIRED_KEPT = 4096  # recently ended transfers whose late frames are dropped quietly


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first position, first slot, length) of each run of consecutive slots."""
    if len(slots) == 0:
        return []
    s = slots.numpy()
    breaks = (np.nonzero(np.diff(s) != 1)[0] + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, len(s)]
    return [(a, int(s[a]), b - a) for a, b in zip(starts, ends, strict=True)]


@dataclass(frozen=True)
class Landed:
    """A transfer whose every layer arrived: what its DONE frame said, and what came in."""

    first_token: int
    bytes: int
    seconds: float  # from `expect` to DONE
    remote_queued_s: float | None = None  # the prompt's wait in the prefill worker's queue, as it measured it
    remote_prefill_s: float | None = None  # its prefill there, queue excluded


@dataclass
class Expected:
    slots: torch.Tensor  # cache slot of every prompt position
    skip: int  # positions below this are already cached here and are not sent
    on_done: Callable[[Landed], None]
    on_fail: Callable[[str], None]
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # slot_runs(slots)
    filled: list[int] = field(default_factory=list)  # per layer: next expected position
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    busy: int = 0  # frames being received into this transfer's slots right now
    dead: bool = False  # cancelled, failed or done: no new frame may start
    released: list[Callable[[], None]] = field(default_factory=list)  # to call when busy drops to 0
    # [2, layers, len(slots), kv_heads, head_dim] CPU tensor frames land in instead of the cache
    # (a tensor-parallel decode worker, whose cache holds only its own heads); its bytes:
    landing: torch.Tensor | None = None
    landing_bytes: memoryview | None = None


class KVReceiver:
    def __init__(self, host: str, port: int, kv_cache: torch.Tensor, secret: str, *, vocab_size: int, layout: str,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout: float = IDLE_TIMEOUT,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        """layout: this cache's handshake.fingerprint; senders must present the same."""
        self.secret, self.vocab_size, self.layout = secret, vocab_size, layout
        self.mismatched = 0  # connections refused for another K/V layout
        self.max_connections, self.idle_timeout, self.handshake_timeout = max_connections, idle_timeout, handshake_timeout
        self.connections = 0  # open now (authenticated or in the handshake)
        self.refused = 0  # connections closed unauthenticated or over the cap
        self.kv_cache = kv_cache  # [2, layers, slots, kv_heads, head_dim]
        self.layers, self.heads, self.dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
        self.num_slots = kv_cache.shape[2]
        self.row_bytes = self.heads * self.dim * kv_cache.element_size()
        # Receiving into the cache needs its bytes addressable from Python: a contiguous CPU
        # tensor. A GPU cache goes through a staging buffer and a device copy instead.
        self._flat: memoryview | None = None
        if kv_cache.device.type == "cpu" and kv_cache.is_contiguous():
            self._flat = memoryview(kv_cache.view(-1).view(torch.uint8).numpy()).cast("B")
        self.lock = threading.Lock()
        self.transfers: dict[int, Expected] = {}  # accepting frames
        self.draining: dict[int, Expected] = {}  # retired with a frame still in flight
        self.retired: OrderedDict[int, None] = OrderedDict()  # ended lately: late frames are dropped
        self.rejected = 0
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="kv-accept", daemon=True).start()

    def expect(self, transfer_id: int, slots: torch.Tensor, skip: int,
               on_done: Callable[[Landed], None], on_fail: Callable[[str], None],
               landing: torch.Tensor | None = None) -> None:
        """Accept a transfer into `slots` (one per prompt position), or, with `landing` (a
        contiguous CPU [2, layers, len(slots), kv_heads, head_dim] tensor), into that: frames
        then carry every KV head of the model, and the caller stores them when done."""
        landing_bytes = None
        if landing is not None:
            if (not landing.is_contiguous() or landing.device.type != "cpu" or landing.shape[2] != len(slots)
                    or landing.shape[1] != self.layers or landing.dtype != self.kv_cache.dtype):
                raise ValueError(f"landing buffer {tuple(landing.shape)} does not fit {len(slots)} positions")
            landing_bytes = memoryview(landing.view(-1).view(torch.uint8).numpy()).cast("B")
        with self.lock:
            slots = slots.cpu()
            self.transfers[transfer_id] = Expected(slots, skip, on_done, on_fail, slot_runs(slots),
                                                   [skip] * self.layers, landing=landing,
                                                   landing_bytes=landing_bytes)

    def cancel(self, transfer_id: int, on_released: Callable[[], None] | None = None) -> bool:
        """Stop accepting frames for the transfer. Returns True when none is in flight, so its
        slots may be reused at once; otherwise `on_released` is called (from a receiver thread)
        once the frame in flight has ended, and the slots must stay reserved until then."""
        with self.lock:
            exp = self.transfers.get(transfer_id) or self.draining.get(transfer_id)
            if exp is None:
                return True
            self._retire(transfer_id, exp)
            if not exp.busy:
                return True
            if on_released is not None:
                exp.released.append(on_released)
            return False

    def in_flight(self, transfer_id: int) -> int:
        """Frames being received for the transfer now (tests and diagnostics)."""
        with self.lock:
            exp = self.transfers.get(transfer_id) or self.draining.get(transfer_id)
            return exp.busy if exp is not None else 0

    def close(self) -> None:
        self._closed = True
        self.sock.close()

    def _retire(self, tid: int, exp: Expected) -> None:
        """Under the lock: no new frame for this transfer starts; those in flight run out."""
        self.transfers.pop(tid, None)
        exp.dead = True
        if exp.busy:
            self.draining[tid] = exp
        self.retired[tid] = None
        if len(self.retired) > _RETIRED_KEPT:
            self.retired.popitem(last=False)

    # -- network threads -----------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            with self.lock:
                full = self.connections >= self.max_connections
                if full:
                    self.refused += 1
                else:
                    self.connections += 1
            if full:  # a flood of connections costs a close each, not a thread each
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Applies to blocking recvs, including MSG_WAITALL ones: first the handshake's short
            # limit, then STALL_TIMEOUT within a frame (idle links: see _Reader.header).
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.handshake_timeout))
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.handshake_timeout))
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            with conn:
                try:
                    handshake.accept(conn, self.secret, self.layout)
                except (handshake.HandshakeError, OSError) as e:
                    with self.lock:
                        self.refused += 1
                        self.mismatched += isinstance(e, handshake.LayoutMismatch)
                    log.warning("KV connection from %s refused: %s", peer, e)
                    return
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(STALL_TIMEOUT))
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(STALL_TIMEOUT))
                self._frames(conn, peer)
        finally:
            with self.lock:
                self.connections -= 1

    def _frames(self, conn: socket.socket, peer) -> None:
        tid = None
        staging = _Staging()  # GPU caches only, reused across this connection's frames
        reader = _Reader(conn, self.idle_timeout)
        try:
            while True:
                raw = reader.header()
                if raw is None:
                    return  # clean close (or an idle link) between frames
                h = Header.unpack(raw)
                tid = h.transfer_id
                if h.kind == DATA:
                    self._data(reader, h, staging)
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

    def _data(self, reader: _Reader, h: Header, staging: _Staging) -> None:
        if h.layer >= self.layers or h.head_dim != self.dim:
            raise FrameError(f"layer {h.layer} / shape [{h.kv_heads},{h.head_dim}] does not fit this cache")
        if CODE_DTYPES[h.dtype] != self.kv_cache.dtype:
            raise FrameError(f"dtype {CODE_DTYPES[h.dtype]} differs from this cache's {self.kv_cache.dtype}")
        end = h.token_start + h.num_tokens
        with self.lock:
            exp = self.transfers.get(h.transfer_id)
            if exp is None:
                if h.transfer_id not in self.retired:
                    raise FrameError(f"unknown transfer {h.transfer_id}")
            else:
                heads = self.heads if exp.landing is None else exp.landing.shape[3]
                if h.kv_heads != heads:
                    raise FrameError(f"{h.kv_heads} KV heads in a frame for a transfer of {heads}")
                if h.token_start != exp.filled[h.layer] or end > len(exp.slots):
                    raise FrameError(f"layer {h.layer} tokens [{h.token_start},{end}) out of order or past the "
                                     f"reservation (expected start {exp.filled[h.layer]}, {len(exp.slots)} tokens)")
                # Claimed before the bytes arrive, so a second connection cannot write the same rows.
                exp.filled[h.layer] = end
                exp.busy += 1
        if exp is None:  # a late frame of an ended transfer: other transfers share this link
            if not reader.discard(h.payload_len):
                raise FrameError(f"truncated payload ({h.payload_len} bytes announced)")
            return
        # Blocks are mostly handed out in order, so a frame usually lands in a few runs of
        # consecutive slots; each run is a contiguous stretch of cache rows (K and V apart).
        runs = [(max(p, h.token_start), s + max(p, h.token_start) - p, min(p + n, end) - max(p, h.token_start))
                for p, s, n in exp.runs if p < end and p + n > h.token_start]
        complete = False
        try:
            if exp.landing_bytes is not None:
                complete = reader.payload(_landing_views(exp, h))
            elif self._flat is not None:
                complete = reader.payload(self._cache_views(h.layer, runs))
            else:
                # Allocated only now: the header, the transfer and the range are checked.
                complete = self._recv_staged(reader, h, exp, runs, staging.get(h.payload_len))
        finally:
            with self.lock:
                exp.busy -= 1
                dead = exp.dead
                callbacks: list[Callable[[], None]] = []
                if dead and not exp.busy:
                    self.draining.pop(h.transfer_id, None)
                    callbacks, exp.released = exp.released, []
                elif complete:
                    exp.bytes += h.payload_len
            for cb in callbacks:  # the slots are quiet now: their owner may hand them out again
                cb()
        if not complete:
            raise FrameError(f"truncated payload ({h.payload_len} bytes announced)")

    def _cache_views(self, layer: int, runs: list[tuple[int, int, int]]) -> list[memoryview]:
        """Where a payload ([2, tokens, heads, dim]: all K rows, then all V rows) goes in the cache."""
        assert self._flat is not None
        row, views = self.row_bytes, []
        for part in (0, 1):
            base = (part * self.layers + layer) * self.num_slots
            for _, slot, n in runs:
                off = (base + slot) * row
                views.append(self._flat[off : off + n * row])
        return views

    def _recv_staged(self, reader: _Reader, h: Header, exp: Expected, runs: list[tuple[int, int, int]],
                     payload: memoryview) -> bool:
        if not reader.payload([payload]):
            return False
        kv = payload_tensor(h, payload).to(self.kv_cache.device, non_blocking=True)
        end = h.token_start + h.num_tokens
        with self.lock:
            if exp.dead:
                return True  # reported as cancelled by the caller; nothing written
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
        return True

    def _done(self, h: Header) -> bool:
        if not 0 <= h.value < self.vocab_size:
            self._fail(h.transfer_id, f"first token {h.value} is outside the vocabulary ({self.vocab_size})")
            return False
        with self.lock:
            exp = self.transfers.get(h.transfer_id)
            if exp is None:
                # Its owner cancelled it (timeout, client gone) or a frame failed it: the sender's
                # NACK is all the prefill worker learns, so say here which it was.
                log.warning("KV transfer %d ended by its sender after it was %s", h.transfer_id,
                            "cancelled or failed here" if h.transfer_id in self.retired else "never expected")
                return False
            busy = exp.busy
            self._retire(h.transfer_id, exp)
        if busy:  # another connection is still writing this transfer's rows
            exp.on_fail("transfer ended while a frame was still arriving")
            return False
        missing = [i for i, f in enumerate(exp.filled) if f != len(exp.slots)]
        if missing:
            exp.on_fail(f"transfer ended with layers {missing[:5]} incomplete")
            return False
        exp.on_done(Landed(h.value, exp.bytes, time.monotonic() - exp.started, *done_phases(h)))
        return True

    def _fail(self, tid: int, why: str) -> None:
        with self.lock:
            exp = self.transfers.get(tid)
            if exp is not None:
                self._retire(tid, exp)
        if exp is not None:
            exp.on_fail(why)


def _landing_views(exp: Expected, h: Header) -> list[memoryview]:
    """Where a payload goes in a landing buffer: per layer, positions are contiguous rows."""
    assert exp.landing is not None and exp.landing_bytes is not None
    _, layers, tokens, heads, dim = exp.landing.shape
    row = heads * dim * exp.landing.element_size()
    views = []
    for part in (0, 1):
        off = ((part * layers + h.layer) * tokens + h.token_start) * row
        views.append(exp.landing_bytes[off : off + h.num_tokens * row])
    return views


class _Staging:
    """A connection's staging buffer (GPU caches), grown to the largest checked frame."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def get(self, n: int) -> memoryview:
        if len(self.buf) < n:
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]


class _Reader:
    """Reads one connection's frames. A payload is read with one scatter call per burst of data,
    straight into its destinations (K rows, V rows) plus the next frame's header buffer, so no
    read is cut at a K/V or frame boundary: fewer syscalls, and fewer GIL acquisitions by this
    thread, which shares its core with the decode engine thread.

    Measured and not kept: MSG_WAITALL (one call per run) made a 45 MiB transfer ~25% slower,
    as it still wakes the reader per segment; an SO_RCVLOWAT mark with no time limit stalled a
    few transfers until the 10 s receive timeout, hence the short wait and fallback in payload().
    """

    lowat_timeouts = 0  # payload reads that fell back to waking on any byte (diagnostics)

    def __init__(self, conn: socket.socket, idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.conn, self.idle_timeout = conn, idle_timeout
        self.hdr = bytearray(HEADER_SIZE)
        self.have = 0  # bytes of the next header already read along with the previous payload

    def header(self) -> bytes | None:
        view = memoryview(self.hdr)
        idle_since = time.monotonic()
        while self.have < HEADER_SIZE:
            try:
                k = self.conn.recv_into(view[self.have :], HEADER_SIZE - self.have, socket.MSG_WAITALL)
            except BlockingIOError:  # SO_RCVTIMEO: an idle link between frames is fine, for a while
                if self.have == 0:
                    if time.monotonic() - idle_since >= self.idle_timeout:
                        return None
                    continue
                raise FrameError(f"header stalled ({self.have} of {HEADER_SIZE} bytes)") from None
            if k == 0:
                if self.have == 0:
                    return None
                raise FrameError(f"connection closed inside a header ({self.have} of {HEADER_SIZE} bytes)")
            self.have += k
        self.have = 0
        return bytes(self.hdr)

    def payload(self, views: list[memoryview]) -> bool:
        """Fill the views in order. False if the connection ends first."""
        views = [v for v in views if v.nbytes]
        spill = memoryview(self.hdr)
        left = sum(v.nbytes for v in views)
        lowat = min(left, LOWAT) if LOWAT > 1 else 1
        if lowat > 1:
            self._set(lowat, _PAYLOAD_WAIT)
        try:
            while views:
                batch = views[:_IOV_BATCH]
                try:
                    k = self.conn.recvmsg_into(batch + [spill] if len(views) <= _IOV_BATCH else batch)[0]
                except BlockingIOError:
                    # The low-water mark was not reached in time (the sender paused, or the
                    # kernel held the window below the mark): wake on any byte from now on.
                    if lowat == 1:
                        raise FrameError("payload stalled") from None
                    lowat = 1
                    self._set(1, STALL_TIMEOUT)
                    _Reader.lowat_timeouts += 1
                    continue
                if k == 0:
                    return False
                left -= k
                while views and k >= views[0].nbytes:
                    k -= views[0].nbytes
                    views.pop(0)
                if views:
                    views[0] = views[0][k:]
                else:
                    self.have = k  # the start of the next frame's header
                if 1 < left < lowat:
                    lowat = left
                    self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
        finally:
            if lowat > 1:  # a lone control frame must wake the reader
                self._set(1, STALL_TIMEOUT)
        return True

    def _set(self, lowat: int, timeout: float) -> None:
        self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
        self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))

    def discard(self, n: int) -> bool:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = self.conn.recv_into(scratch[: min(n, scratch.nbytes)])
            if k == 0:
                return False
            n -= k
        return True


# Wake the reader per LOWAT bytes of a payload rather than per segment: on loopback each wake-up
# of a sleeping reader costs the *sender* (the loopback delivery runs on its CPU), and a reader
# that drains 64 KiB at a time halved a 45 MiB transfer's speed. If the mark is not reached within
# _PAYLOAD_WAIT (the kernel may hold the window below it), the read falls back to any byte.
LOWAT = 512 << 10
_PAYLOAD_WAIT = 0.02
_IOV_BATCH = 256  # destination buffers per recvmsg call (the kernel takes up to 1024)


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
