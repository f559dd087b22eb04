"""KV transfer throughput vs a raw loopback socket copy of the same bytes, in the same run.

    ~/.cache/phasesplit/venv/bin/python tests/bench/kv_transfer.py [--tokens 2048] [--repeats 15]

Sends one request's K/V (SmolLM2 shape: 30 layers, 3 KV heads, head dim 64, bf16) layer by layer
through phasesplit's KVSender -> KVReceiver (framing, validation, writes into the paged cache),
then the same bytes in the same 30 pieces over a plain socket into a buffer. The two alternate
(which goes first flips every round, so neither always runs just after the other), and each
round gives one paired ratio: on a shared machine the load drifts between rounds far more than
within one. Prints the median time of each, and the median and spread of the per-round ratios
(target >= 0.8).

Like a prefill worker talking to a decode worker it has served before, phasesplit's sender
reuses its open connection to the receiver (the warm-up round opens it); the raw copy opens a
new connection every round, which costs it about 0.3 ms of ~15.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import torch

from phasesplit.runtime.kv.receiver import KVReceiver
from phasesplit.runtime.kv.sender import KVLinks

LAYERS, HEADS, DIM = 30, 3, 64
SECRET = "bench-internal-secret"
LAYOUT = "bench-model/bfloat16/block16/bench"  # both ends the same: the handshake compares, nothing more


def phasesplit_once(links: KVLinks, receiver: KVReceiver, layers: list[torch.Tensor], tokens: int, tid: int) -> float:
    done = threading.Event()
    receiver.expect(tid, torch.arange(tokens), 0, lambda *a: done.set(), lambda why: print("FAILED", why))
    t0 = time.perf_counter()
    sender = links.sender(("127.0.0.1", receiver.port), tid)
    for i, kv in enumerate(layers):
        sender.send_layer(i, 0, kv)
    sender.finish(1)
    sender.wait(60)
    assert done.is_set()
    return time.perf_counter() - t0


def raw_once(payloads: list[memoryview]) -> float:
    total = sum(p.nbytes for p in payloads)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    buf = bytearray(total)

    def sink() -> None:
        conn, _ = srv.accept()
        view, got = memoryview(buf), 0
        while got < total:
            got += conn.recv_into(view[got:])
        conn.sendall(b"k")
        conn.close()

    th = threading.Thread(target=sink)
    th.start()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for p in payloads:
            c.sendall(p)
        c.recv(1)
    elapsed = time.perf_counter() - t0
    th.join()
    srv.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    cache = torch.zeros(2, LAYERS, a.tokens, HEADS, DIM, dtype=torch.bfloat16)
    receiver = KVReceiver("127.0.0.1", 0, cache, SECRET, vocab_size=2, layout=LAYOUT)
    links = KVLinks(SECRET, LAYOUT)  # one link for every round, as a prefill worker keeps it
    layers = [torch.randn(2, a.tokens, HEADS, DIM).to(torch.bfloat16) for _ in range(LAYERS)]
    payloads = [memoryview(kv.view(torch.uint8).numpy()).cast("B") for kv in layers]
    nbytes = sum(p.nbytes for p in payloads)
    ours, raw = [], []
    for r in range(a.repeats + 1):  # the first round warms both paths up and is dropped
        if r % 2:
            t_raw = raw_once(payloads)
            t_ours = phasesplit_once(links, receiver, layers, a.tokens, 1000 + r)
        else:
            t_ours = phasesplit_once(links, receiver, layers, a.tokens, 1000 + r)
            t_raw = raw_once(payloads)
        if r:
            ours.append(t_ours)
            raw.append(t_raw)
    assert torch.equal(cache[:, LAYERS - 1], layers[-1]), "the receiver wrote what was sent"
    mo, mr = statistics.median(ours), statistics.median(raw)
    ratios = sorted(r / o for o, r in zip(ours, raw, strict=True))
    q1, q3 = statistics.quantiles(ratios, n=4)[0], statistics.quantiles(ratios, n=4)[2]
    print(f"payload: {nbytes / 2**20:.1f} MiB ({a.tokens} tokens x {LAYERS} layers, bf16), {a.repeats} rounds")
    print(f"phasesplit KV transfer: {mo * 1e3:8.1f} ms  {nbytes / mo / 2**30:6.2f} GiB/s (median)")
    print(f"raw loopback socket   : {mr * 1e3:8.1f} ms  {nbytes / mr / 2**30:6.2f} GiB/s (median)")
    print(f"per-round ratio (phasesplit / raw throughput): median {statistics.median(ratios):.2f}, "
          f"quartiles {q1:.2f}-{q3:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f}")
    links.close()
    receiver.close()


if __name__ == "__main__":
    main()
