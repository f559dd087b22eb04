"""Tensor-parallel ranks: one process per rank, rank 0 runs the engine and drives the others.

Rank 0 (the serving process) spawns ranks 1..N-1 and joins them in a torch.distributed group
(gloo on CPU, NCCL on CUDA) for the data: the all-reduces inside the forward pass, and K/V moved
between ranks (gathered to rank 0 for the split prefill's stream, scattered from it when a decode
worker's remote prefill lands). The control messages (which step to run, with which block tables)
go over one pipe per rank, as nano-vllm's rank 0 writes each call to shared memory: a rank waits
for work on its pipe with no collective timeout while the server is idle, and the pipe's end
tells it that rank 0 is gone.

Every rank receives every message in the same order and runs the same collectives in the same
order; that, not locking, is what keeps them in step. Messages are sent from the engine thread
only.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# A collective waits at most this long for a peer (a step of a long prompt on a slow CPU takes
# seconds; a dead peer is usually noticed at once by its closed socket).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
START_TIMEOUT = 600.0  # seconds for the other ranks to load their shards


class RankError(RuntimeError):
    pass


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> None:
    # All ranks are local (one pod): gloo's connections go over loopback, not over whatever
    # interface the host name resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend_for(device), init_method=init_method, world_size=size, rank=rank,
                            timeout=COLLECTIVE_TIMEOUT)


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum a partial product over the ranks. On CPU a bf16/fp16 one is summed in fp32 and
    rounded once, as one rank's matmul would (gloo adds in the tensor's own dtype, rounding at
    every add); NCCL sums low precision natively, as vLLM and Megatron do."""
    if t.device.type == "cpu" and t.dtype != torch.float32:
        acc = t.float()
        dist.all_reduce(acc)
        return acc.to(t.dtype)
    dist.all_reduce(t)
    return t


class Ranks:
    """Rank 0's handle on the other ranks: their processes and control pipes."""

    def __init__(self, size: int, files: Any, rc: Any) -> None:
        """Start the other ranks; `join` the group once this rank's own shard is loaded."""
        self.size = size
        self._dir = tempfile.mkdtemp(prefix="phasesplit-tp-")
        self.init_method = init_method = f"file://{os.path.join(self._dir, 'rendezvous')}"
        ctx = mp.get_context("spawn")  # a fork would copy the parent's threads and CUDA state
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(files, rc, rank, size, init_method, theirs),
                            name=f"phasesplit-tp-rank{rank}", daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)
        log.info("tensor parallel: started %d more rank(s)", size - 1)

    def join(self, device: torch.device) -> None:
        """Join the group, watching the other ranks: one that dies before joining would
        otherwise leave rank 0 waiting for it until the rendezvous times out."""
        joined, errors = threading.Event(), []

        def join() -> None:
            try:
                init_group(0, self.size, self.init_method, device)
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(e)
            finally:
                joined.set()

        threading.Thread(target=join, name="tp-join", daemon=True).start()
        while not joined.wait(0.5):
            for rank, (c, p) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
                if not p.is_alive():
                    why = c.recv() if c.poll() else f"exit code {p.exitcode}; its log is above"
                    raise RankError(f"tensor-parallel rank {rank} failed before joining: {why}")
        if errors:
            raise errors[0]

    def send(self, msg: tuple) -> None:
        """One control message to every other rank (engine thread only)."""
        for c in self.conns:
            c.send(msg)

    def wait_ready(self) -> None:
        """Block until every rank has its shard and cache, or raise naming the one that failed."""
        deadline = time.monotonic() + START_TIMEOUT
        for rank, (c, p) in enumerate(zip(self.conns, self.procs, strict=True), start=1):
            while not c.poll(0.5):
                if not p.is_alive():
                    raise RankError(f"tensor-parallel rank {rank} exited with {p.exitcode} while loading")
                if time.monotonic() > deadline:
                    raise RankError(f"tensor-parallel rank {rank} not ready after {START_TIMEOUT:.0f}s")
            reply = c.recv()
            if reply != "ready":
                raise RankError(f"tensor-parallel rank {rank} failed to start: {reply}")

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("exit",))
                c.close()
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)


def _worker_main(files: Any, rc: Any, rank: int, size: int, init_method: str, conn: Connection) -> None:
    """Ranks 1..N-1: load this rank's shard, then run what rank 0 sends until it says exit or
    its pipe closes. Signals are for rank 0 (it drains requests first, then ends the ranks)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    from phasesplit.runtime.engine.model_runner import ModelRunner

    try:
        runner = ModelRunner(files, rc, rank=rank, control=conn, init_method=init_method)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which names it in its error
        log.exception("rank %d failed to start", rank)
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break  # rank 0 is gone
        if msg[0] == "exit":
            break
        try:
            runner.handle(msg)
        except Exception:
            log.exception("rank %d failed in %s; exiting (rank 0 sees its peer gone)", rank, msg[0])
            os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
