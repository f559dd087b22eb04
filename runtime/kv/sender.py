"""Prefill side of the KV transfer: streams layers to the decode worker from a sender thread.

The engine thread only copies a finished layer's K/V out of the cache and queues it; the socket
write happens here, while the engine computes the next layer (the overlap the split depends on).
"""

from __future__ import annotations

import queue
import socket
import threading

import torch

from phasesplit.runtime.kv.wire import ACK, DONE, HEADER_SIZE, Header, data_frame


class TransferFailed(RuntimeError):
    pass


class KVSender:
    def __init__(self, address: tuple[str, int], transfer_id: int, timeout: float = 30.0) -> None:
        self.address, self.transfer_id, self.timeout = address, transfer_id, timeout
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.bytes = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{transfer_id}", daemon=True)
        self._thread.start()

    def send_layer(self, layer: int, token_start: int, kv: torch.Tensor) -> None:
        """kv: [2, tokens, kv_heads, head_dim] on CPU, owned by the sender from now on."""
        self.q.put((layer, token_start, kv))

    def finish(self, first_token: int) -> None:
        self.q.put(("done", first_token))

    def abort(self) -> None:
        self.q.put(("abort", 0))

    def wait(self, timeout: float) -> int:
        """Block until the receiver acknowledged; returns bytes sent. Raises TransferFailed."""
        if not self.done.wait(timeout):
            self.abort()
            raise TransferFailed(f"no acknowledgement from {self.address} within {timeout}s")
        if self.error is not None:
            raise TransferFailed(str(self.error))
        return self.bytes

    def _run(self) -> None:
        sock = None
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                item = self.q.get()
                if item[0] == "abort":
                    raise TransferFailed("transfer aborted")
                if item[0] == "done":
                    sock.sendall(Header(DONE, self.transfer_id, value=item[1]).pack())
                    reply = _recv_exact(sock, HEADER_SIZE)
                    if Header.unpack(reply).kind != ACK:
                        raise TransferFailed(f"decode worker {self.address} refused the transfer")
                    return
                layer, start, kv = item
                head, payload = data_frame(self.transfer_id, layer, start, kv)
                sock.sendall(head)
                sock.sendall(payload)
                self.bytes += len(head) + payload.nbytes
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request
            self.error = e
        finally:
            if sock is not None:
                sock.close()
            self.done.set()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise TransferFailed("connection closed before the acknowledgement")
        buf += chunk
    return buf
