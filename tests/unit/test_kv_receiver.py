"""KVReceiver on loopback: frames land in the reserved slots and nowhere else; a cancelled
transfer's slots stay reserved until the frame landing in them has ended."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from phasesplit.runtime.kv import handshake
from phasesplit.runtime.kv.receiver import KVReceiver, Landed
from phasesplit.runtime.kv.sender import KVLinks, TransferFailed
from phasesplit.runtime.kv.wire import ACK, DATA, DONE, HEADER_SIZE, NACK, Header, data_frame

LAYERS, SLOTS, HEADS, DIM = 2, 64, 3, 8
SECRET = "unit-test-internal-secret"
VOCAB = 1000
LAYOUT = handshake.fingerprint("unit-model", "bfloat16", 16, LAYERS, HEADS, DIM)


@pytest.fixture
def receiver():
    cache = torch.zeros(2, LAYERS, SLOTS, HEADS, DIM, dtype=torch.bfloat16)
    r = KVReceiver("127.0.0.1", 0, cache, SECRET, vocab_size=VOCAB, layout=LAYOUT)
    yield r
    r.close()


@pytest.fixture
def links():
    """A prefill worker's links (each test its own, so no connection outlives its receiver)."""
    kl = KVLinks(SECRET, LAYOUT)
    yield kl
    kl.close()


def authed(port: int) -> socket.socket:
    """A raw connection that has passed the handshake (the tests then speak frames on it)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(10)
    handshake.connect(s, SECRET, LAYOUT)
    return s


class Outcome:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.done: Landed | None = None
        self.failed: str | None = None

    def on_done(self, landed: Landed) -> None:
        self.done = landed
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


def test_frames_land_in_reserved_slots_only(receiver, links):
    slots = [3, 4, 5, 20, 21, 40]  # three runs of consecutive slots
    out = expect(receiver, 7, slots)
    kvs = [layer_kv(len(slots), i) for i in range(LAYERS)]
    sender = links.sender(("127.0.0.1", receiver.port), 7)
    for layer, kv in enumerate(kvs):
        sender.send_layer(layer, 0, kv[:, :4].clone())  # two frames per layer, in token order
        sender.send_layer(layer, 4, kv[:, 4:].clone())
    sender.finish(99, queued_s=0.25, compute_s=1.5)
    assert sender.wait(10) > 0
    assert out.done is not None and out.done.first_token == 99
    # The prefill worker's own phase times ride on DONE, for the decode worker's timing.
    assert (out.done.remote_queued_s, out.done.remote_prefill_s) == (0.25, 1.5)
    cache = receiver.kv_cache
    for layer, kv in enumerate(kvs):
        assert torch.equal(cache[:, layer, slots], kv)
    others = [s for s in range(SLOTS) if s not in slots]
    assert not cache[:, :, others].any(), "no byte outside the reservation"


def test_truncated_frame_fails_its_transfer_only(receiver, links):
    victim = expect(receiver, 1, [0, 1, 2, 3])
    other = expect(receiver, 2, [10, 11, 12, 13])
    kv = layer_kv(4, 5)
    head, payload = data_frame(1, 0, 0, kv)
    with authed(receiver.port) as s:
        s.sendall(head + bytes(payload)[: payload.nbytes // 3])
        s.shutdown(socket.SHUT_WR)
        s.recv(16)
    assert victim.event.wait(10) and victim.failed is not None
    assert "truncated" in victim.failed
    assert receiver.rejected == 1
    assert not receiver.kv_cache[:, :, 10:14].any()
    # the other transfer still completes, on a connection of its own
    sender = links.sender(("127.0.0.1", receiver.port), 2)
    for layer in range(LAYERS):
        sender.send_layer(layer, 0, layer_kv(4, 10 + layer))
    sender.finish(3)
    sender.wait(10)
    assert other.done is not None
    assert other.done.remote_queued_s is None and other.done.remote_prefill_s is None  # none were reported
    assert torch.equal(receiver.kv_cache[:, 1, 10:14], layer_kv(4, 11))


def test_cancel_mid_frame_defers_the_release(receiver):
    """The frame in flight keeps landing in the cancelled transfer's slots, so they must not be
    handed out until it ends; the link goes on carrying other transfers."""
    cancelled = expect(receiver, 5, list(range(32)))
    kv = layer_kv(32, 1)
    head, payload = data_frame(5, 0, 0, kv)
    raw = bytes(payload)
    released = threading.Event()
    with authed(receiver.port) as s:
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


def test_cancel_when_idle_releases_at_once(receiver, links):
    expect(receiver, 8, [0, 1])
    assert receiver.cancel(8, lambda: pytest.fail("nothing was in flight")) is True
    sender = links.sender(("127.0.0.1", receiver.port), 8)
    sender.send_layer(0, 0, layer_kv(2, 0))
    sender.finish(1)
    with pytest.raises(TransferFailed, match="refused"):
        sender.wait(10)


# -- hostile peers (issue 13): nothing reaches a reservation or an allocation unauthenticated,
# every bad frame is refused, and the receiver goes on serving real transfers --------------------


@pytest.fixture
def staged():
    """A receiver on the staging path (as for a GPU cache), the one that allocates per frame."""
    cache = torch.zeros(2, LAYERS, SLOTS, HEADS, DIM * 2, dtype=torch.bfloat16)[..., :DIM]
    assert not cache.is_contiguous()
    r = KVReceiver("127.0.0.1", 0, cache, SECRET, vocab_size=VOCAB, layout=LAYOUT, max_connections=16, handshake_timeout=0.5)
    yield r
    r.close()


def huge_header(tid: int) -> bytes:
    """A well-formed DATA header whose shape claims ~1.9 GB of payload."""
    tokens = (1 << 30) // (HEADS * DIM * 2)  # bf16: 2 bytes, K and V
    h = Header(DATA, tid, 0, 0, tokens, HEADS, DIM, dtype=2, payload_len=2 * tokens * HEADS * DIM * 2)
    return h.pack()


def closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def transfer_works(links: KVLinks, r: KVReceiver, tid: int) -> None:
    out = expect(r, tid, [50, 51, 52])
    sender = links.sender(("127.0.0.1", r.port), tid)
    for layer in range(LAYERS):
        sender.send_layer(layer, 0, layer_kv(3, 30 + layer))
    sender.finish(5)
    sender.wait(10)
    assert out.done is not None and out.done.first_token == 5
    assert torch.equal(r.kv_cache[:, 1, [50, 51, 52]], layer_kv(3, 31))


def peak_allocation(fn) -> int:
    import tracemalloc
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_unauthenticated_connection_is_refused_before_any_allocation(staged, links):
    victim = expect(staged, 77, list(range(16)))

    def attack() -> None:
        with socket.create_connection(("127.0.0.1", staged.port)) as s:
            s.sendall(huge_header(77))  # no handshake: straight to a frame
            assert closed_by_peer(s)
        # a wrong proof of the secret is no better
        with socket.create_connection(("127.0.0.1", staged.port)) as s:
            s.settimeout(10)
            with pytest.raises(handshake.HandshakeError):
                handshake.connect(s, "not-the-secret-at-all", LAYOUT)
            assert closed_by_peer(s)

    peak = peak_allocation(attack)
    print(f"\nunauthenticated: refused={staged.refused} peak Python allocation {peak / 1024:.0f} KiB")
    assert staged.refused == 2
    assert peak < 4 << 20, "nothing near the claimed payload was allocated"
    assert staged.in_flight(77) == 0 and not victim.event.is_set(), "the reservation was never touched"
    assert not staged.kv_cache.any()
    transfer_works(links, staged, 78)


def test_oversized_payload_and_bad_lengths_are_rejected_unallocated(staged, links):
    expect(staged, 90, list(range(8)))
    bad_len = Header(DATA, 90, 0, 0, 4, HEADS, DIM, dtype=2, payload_len=2 * 4 * HEADS * DIM * 2)
    bad_len.payload_len += 1  # CRC is valid; the length does not match the shape

    def attack() -> None:
        for raw in (huge_header(90), bad_len.pack()):
            with authed(staged.port) as s:
                s.sendall(raw)
                assert closed_by_peer(s)

    peak = peak_allocation(attack)
    print(f"\noversized: rejected={staged.rejected} peak Python allocation {peak / 1024:.0f} KiB")
    assert staged.rejected == 2
    assert peak < 4 << 20
    transfer_works(links, staged, 91)


def test_guessed_transfer_ids_are_rejected(receiver, links):
    import random
    real = expect(receiver, random.getrandbits(64), [1, 2, 3, 4])
    guesses = [random.getrandbits(64) for _ in range(20)]
    for tid in guesses:
        h, p = data_frame(tid, 0, 0, layer_kv(4, 1))
        with authed(receiver.port) as s:
            s.sendall(h + bytes(p))
            assert closed_by_peer(s)
    with authed(receiver.port) as s:  # a DONE for a guessed id is answered NACK
        s.sendall(Header(DONE, guesses[0], value=1).pack())
        assert Header.unpack(s.recv(HEADER_SIZE, socket.MSG_WAITALL)).kind == NACK
    print(f"\nguessed ids: rejected={receiver.rejected} of {len(guesses)} frames")
    assert receiver.rejected == len(guesses)
    assert not real.event.is_set() and not receiver.kv_cache.any()
    transfer_works(links, receiver, 12345)


def test_out_of_vocabulary_first_token_fails_the_transfer(receiver, links):
    out = expect(receiver, 60, [0, 1])
    sender = links.sender(("127.0.0.1", receiver.port), 60)
    for layer in range(LAYERS):
        sender.send_layer(layer, 0, layer_kv(2, layer))
    sender.finish(VOCAB)  # one past the last token id
    with pytest.raises(TransferFailed, match="refused"):
        sender.wait(10)
    assert out.failed is not None and "outside the vocabulary" in out.failed
    assert out.done is None
    transfer_works(links, receiver, 61)


def test_a_thousand_idle_connections_are_shed(staged, links):
    t0 = time.monotonic()
    socks = []
    for _ in range(1000):
        s = socket.socket()
        s.connect(("127.0.0.1", staged.port))
        socks.append(s)
    try:
        closed = sum(closed_by_peer(s, timeout=10) for s in socks)
        took = time.monotonic() - t0
        print(f"\n1000 idle connections: {closed} closed by the receiver in {took:.1f}s, "
              f"refused={staged.refused}, open now={staged.connections}")
        assert closed == 1000
        wait_until(lambda: staged.connections == 0, "every connection thread has ended")
        assert staged.refused == 1000
    finally:
        for s in socks:
            s.close()
    transfer_works(links, staged, 99)


def test_an_idle_authenticated_link_times_out_and_the_sender_reconnects(links):
    cache = torch.zeros(2, LAYERS, SLOTS, HEADS, DIM, dtype=torch.bfloat16)
    r = KVReceiver("127.0.0.1", 0, cache, SECRET, vocab_size=VOCAB, layout=LAYOUT, idle_timeout=0.5)
    try:
        transfer_works(links, r, 1)
        wait_until(lambda: r.connections == 0, "the idle link was closed", timeout=15)
        out = expect(r, 2, [7, 8])
        sender = links.sender(("127.0.0.1", r.port), 2)
        for layer in range(LAYERS):
            sender.send_layer(layer, 0, layer_kv(2, layer))
        sender.finish(3)
        sender.wait(10)
        assert out.done is not None
    finally:
        r.close()


def test_a_landing_buffer_takes_every_head_and_leaves_the_cache_alone(receiver, links):
    """A tensor-parallel decode worker: its cache holds some heads (here 3), frames carry all the
    model's heads (here 5) into the transfer's landing buffer, which the engine then scatters."""
    heads, slots, skip = 5, [8, 9, 10, 11, 30], 1
    landing = torch.zeros(2, LAYERS, len(slots), heads, DIM, dtype=torch.bfloat16)
    out = Outcome()
    receiver.expect(11, torch.tensor(slots), skip, out.on_done, out.on_fail, landing=landing)
    g = torch.Generator().manual_seed(5)
    kvs = [torch.randn(2, len(slots) - skip, heads, DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    sender = links.sender(("127.0.0.1", receiver.port), 11)
    for layer, kv in enumerate(kvs):
        sender.send_layer(layer, skip, kv[:, :2].clone())
        sender.send_layer(layer, skip + 2, kv[:, 2:].clone())
    sender.finish(42)
    assert sender.wait(10) > 0
    assert out.done is not None and out.done.first_token == 42, out.failed
    for layer, kv in enumerate(kvs):
        assert torch.equal(landing[:, layer, skip:], kv)
    assert not landing[:, :, :skip].any()
    assert not receiver.kv_cache.any()  # nothing went into the cache's rows


def test_a_frame_with_the_wrong_head_count_fails_its_transfer(receiver, links):
    out = expect(receiver, 12, [1, 2])  # a plain transfer into the cache: 3 heads
    sender = links.sender(("127.0.0.1", receiver.port), 12)
    sender.send_layer(0, 0, torch.zeros(2, 2, HEADS + 1, DIM, dtype=torch.bfloat16))
    sender.finish(1)
    with pytest.raises(TransferFailed):
        sender.wait(10)
    assert out.event.wait(10) and out.failed and "KV heads" in out.failed
    assert not receiver.kv_cache.any()


def test_sender_of_another_layout_is_refused_by_both_ends_naming_both(receiver):
    """Same secret, same frame geometry, another model/block size: K/V that would decode into
    garbage without any frame check noticing. Both ends refuse, each naming both layouts, before
    a single frame is sent."""
    other = handshake.fingerprint("unit-model-finetune", "bfloat16", 32, LAYERS, HEADS, DIM)
    done = Outcome()
    receiver.expect(9, torch.arange(8), 0, done.on_done, done.on_fail)
    foreign = KVLinks(SECRET, other)
    sender = foreign.sender(("127.0.0.1", receiver.port), 9)
    sender.send_layer(0, 0, torch.ones(2, 8, HEADS, DIM, dtype=torch.bfloat16))
    sender.finish(5)
    with pytest.raises(TransferFailed) as e:
        sender.wait(10)
    foreign.close()
    print(f"\nsender: {e.value}")
    assert "KV layout mismatch" in str(e.value) and LAYOUT in str(e.value) and other in str(e.value)
    deadline = time.monotonic() + 10
    while receiver.mismatched < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.mismatched == 1 and receiver.refused == 1
    assert not receiver.kv_cache.any(), "nothing was written into the cache"
    assert not done.event.is_set(), "the transfer neither completed nor was decoded"


def test_closing_the_links_fails_their_unfinished_transfers_and_ends_their_threads(receiver):
    """A prefill worker shutting down: a transfer still on a link fails at once (not after its
    timeout), and no link thread or connection outlives the worker's KVLinks."""
    kl = KVLinks(SECRET, LAYOUT, timeout=60)
    expect(receiver, 21, [0, 1])
    sender = kl.sender(("127.0.0.1", receiver.port), 21)
    sender.send_layer(0, 0, layer_kv(2, 0))
    wait_until(lambda: receiver.connections == 1, "the link connected")
    link_threads = [t for t in threading.enumerate() if t.name == f"kv-link-127.0.0.1:{receiver.port}"]
    assert len(link_threads) == 1
    t0 = time.monotonic()
    kl.close()
    with pytest.raises(TransferFailed, match="closed"):
        sender.wait(30)
    assert time.monotonic() - t0 < 5
    link_threads[0].join(5)
    assert not link_threads[0].is_alive()
    wait_until(lambda: receiver.connections == 0, "the receiver saw the connection close")


def test_two_workers_links_are_their_own(receiver):
    """Links belong to their KVLinks, not to the process: another worker's (here: in the same
    process, as in tests) opens its own connection to the same decode worker."""
    a, b = KVLinks(SECRET, LAYOUT), KVLinks(SECRET, LAYOUT)
    try:
        for kl, tid in ((a, 31), (b, 32)):
            out = expect(receiver, tid, [tid])
            sender = kl.sender(("127.0.0.1", receiver.port), tid)
            for layer in range(LAYERS):
                sender.send_layer(layer, 0, layer_kv(1, layer))
            sender.finish(1)
            sender.wait(10)
            assert out.done is not None
        assert receiver.connections == 2
        assert a.sender(("127.0.0.1", receiver.port), 33).link is not b.sender(("127.0.0.1", receiver.port), 34).link
    finally:
        a.close()
        b.close()


def test_receiver_refuses_a_forged_fingerprint_in_the_sender_answer(receiver):
    """A sender that read the receiver's layout but answers with another one (an old or foreign
    worker ignoring the check) is refused by the receiver itself, by name."""
    other = handshake.fingerprint("other-model", "float32", 16, LAYERS, HEADS, DIM)
    with socket.create_connection(("127.0.0.1", receiver.port)) as s:
        s.settimeout(10)
        with pytest.raises(handshake.LayoutMismatch):
            handshake.connect(s, SECRET, other)
        assert closed_by_peer(s)
    deadline = time.monotonic() + 10
    while receiver.mismatched < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.mismatched == 1


def test_fingerprint_names_every_layout_field():
    base = dict(model="m", dtype="bfloat16", block_size=16, layers=30, kv_heads=3, head_dim=64)
    fp = handshake.fingerprint(**base)
    assert fp == "m/bfloat16/block16/30x3x64"
    for k, v in (("model", "m2"), ("dtype", "float32"), ("block_size", 32), ("layers", 31), ("kv_heads", 4),
                 ("head_dim", 128)):
        assert handshake.fingerprint(**{**base, k: v}) != fp, k
