"""KVReceiver on loopback: frames land in the reserved slots and nowhere else; a cancelled
transfer's slots stay reserved until the frame landing in them has ended."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from phasesplit.runtime.kv.receiver import KVReceiver
from phasesplit.runtime.kv.sender import KVSender, TransferFailed
from phasesplit.runtime.kv.wire import ACK, DONE, HEADER_SIZE, NACK, Header, data_frame

LAYERS, SLOTS, HEADS, DIM = 2, 64, 3, 8


@pytest.fixture
def receiver():
    cache = torch.zeros(2, LAYERS, SLOTS, HEADS, DIM, dtype=torch.bfloat16)
    r = KVReceiver("127.0.0.1", 0, cache)
    yield r
    r.close()


class Outcome:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.done: tuple[int, int, float] | None = None
        self.failed: str | None = None

    def on_done(self, first: int, nbytes: int, seconds: float) -> None:
        self.done = (first, nbytes, seconds)
        self.event.set()

    def on_fail(self, why: str) -> None:
        self.failed = why
        self.event.set()


def expect(receiver: KVReceiver, tid: int, slots: list[int]) -> Outcome:
    out = Outcome()
    receiver.expect(tid, torch.tensor(slots), 0, out.on_done, out.on_fail)
    return out


def layer_kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, HEADS, DIM, generator=g).to(torch.bfloat16)


def wait_until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_frames_land_in_reserved_slots_only(receiver):
    slots = [3, 4, 5, 20, 21, 40]  # three runs of consecutive slots
    out = expect(receiver, 7, slots)
    kvs = [layer_kv(len(slots), i) for i in range(LAYERS)]
    sender = KVSender(("127.0.0.1", receiver.port), 7)
    for layer, kv in enumerate(kvs):
        sender.send_layer(layer, 0, kv[:, :4].clone())  # two frames per layer, in token order
        sender.send_layer(layer, 4, kv[:, 4:].clone())
    sender.finish(99)
    assert sender.wait(10) > 0
    assert out.done is not None and out.done[0] == 99
    cache = receiver.kv_cache
    for layer, kv in enumerate(kvs):
        assert torch.equal(cache[:, layer, slots], kv)
    others = [s for s in range(SLOTS) if s not in slots]
    assert not cache[:, :, others].any(), "no byte outside the reservation"


def test_truncated_frame_fails_its_transfer_only(receiver):
    victim = expect(receiver, 1, [0, 1, 2, 3])
    other = expect(receiver, 2, [10, 11, 12, 13])
    kv = layer_kv(4, 5)
    head, payload = data_frame(1, 0, 0, kv)
    with socket.create_connection(("127.0.0.1", receiver.port)) as s:
        s.sendall(head + bytes(payload)[: payload.nbytes // 3])
        s.shutdown(socket.SHUT_WR)
        s.recv(16)
    assert victim.event.wait(10) and victim.failed is not None
    assert "truncated" in victim.failed
    assert receiver.rejected == 1
    assert not receiver.kv_cache[:, :, 10:14].any()
    # the other transfer still completes, on a connection of its own
    sender = KVSender(("127.0.0.1", receiver.port), 2)
    for layer in range(LAYERS):
        sender.send_layer(layer, 0, layer_kv(4, 10 + layer))
    sender.finish(3)
    sender.wait(10)
    assert other.done is not None
    assert torch.equal(receiver.kv_cache[:, 1, 10:14], layer_kv(4, 11))


def test_cancel_mid_frame_defers_the_release(receiver):
    """The frame in flight keeps landing in the cancelled transfer's slots, so they must not be
    handed out until it ends; the link goes on carrying other transfers."""
    cancelled = expect(receiver, 5, list(range(32)))
    kv = layer_kv(32, 1)
    head, payload = data_frame(5, 0, 0, kv)
    raw = bytes(payload)
    released = threading.Event()
    with socket.create_connection(("127.0.0.1", receiver.port)) as s:
        s.sendall(head + raw[:100])
        wait_until(lambda: receiver.in_flight(5) == 1, "the frame is being received")
        assert receiver.cancel(5, released.set) is False, "a frame is landing: the slots are busy"
        assert not released.is_set()
        assert receiver.cancel(5) is False, "still busy for a second caller"
        s.sendall(raw[100:])  # the rest of the frame arrives: now the slots are quiet
        assert released.wait(10)
        assert receiver.in_flight(5) == 0
        assert receiver.cancel(5) is True
        # A late frame of the cancelled transfer is dropped without breaking the link ...
        head2, payload2 = data_frame(5, 1, 0, kv)
        s.sendall(head2 + bytes(payload2))
        # ... which then carries another transfer to completion.
        other = expect(receiver, 6, [40, 41])
        for layer in range(LAYERS):
            h, p = data_frame(6, layer, 0, layer_kv(2, 20 + layer))
            s.sendall(h + bytes(p))
        s.sendall(Header(DONE, 6, value=1).pack())
        assert Header.unpack(s.recv(HEADER_SIZE, socket.MSG_WAITALL)).kind == ACK
        s.sendall(Header(DONE, 5, value=1).pack())
        assert Header.unpack(s.recv(HEADER_SIZE, socket.MSG_WAITALL)).kind == NACK
    assert other.done is not None and cancelled.done is None
    assert receiver.rejected == 0
    assert not receiver.kv_cache[:, 1, :32].any(), "the late frame wrote nothing"


def test_cancel_when_idle_releases_at_once(receiver):
    expect(receiver, 8, [0, 1])
    assert receiver.cancel(8, lambda: pytest.fail("nothing was in flight")) is True
    sender = KVSender(("127.0.0.1", receiver.port), 8)
    sender.send_layer(0, 0, layer_kv(2, 0))
    sender.finish(1)
    with pytest.raises(TransferFailed, match="refused"):
        sender.wait(10)
