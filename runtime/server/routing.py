"""Routing rules: which decode worker takes a request, which prefill workers to try. Pure.

The router (router.py) keeps the pools current (polling /internal/state, Kubernetes discovery)
and calls these with what it last saw.

Pairing is version-coherent: every worker reports its revision (the operator's hash of what
decides whether two workers' K/V are interchangeable: model, dtype, block size, image, args;
render.revision), and a decode worker is only ever given prefill workers of its own revision.
During a rollout old and new pairs serve side by side; a decode worker whose revision has no
live prefill worker left prefills locally (it is given none), and one that has is preferred.
"""

from __future__ import annotations

import random
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass
class Worker:
    url: str
    up: bool = False
    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0
    waiting: int = 0  # requests waiting for KV blocks (LLMEngine.num_waiting)
    waiting_tokens: int = 0  # prompt tokens of requests not started (the worker's queue gauge)
    queued_tokens: int = 0  # prompt tokens still to prefill, part-way prompts included
    inflight: int = 0  # requests this router sent since the last poll: keeps picks spread out
    last_seen: float = 0.0
    revision: str = ""  # the worker's --revision ("" where none was given: pairs with "" only)
    takes_requests: bool = False  # a prefill worker that serves whole requests too (lend_prefill)
    # A decode worker's fitted step with one stream more, and its ITL target (None: not reported).
    next_step_s: float | None = None
    itl_target_s: float | None = None


@dataclass
class Pool:
    """Workers of one phase by URL. Discovery replaces the mapping as a whole (under a lock), and
    a published mapping is never changed, so the event loop may iterate `workers` while the
    discovery thread sets new URLs."""

    workers: Mapping[str, Worker] = field(default_factory=lambda: MappingProxyType({}))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def set_urls(self, urls: list[str]) -> None:
        with self._lock:
            old = self.workers
            self.workers = MappingProxyType({u: old.get(u) or Worker(u) for u in dict.fromkeys(urls)})

    def live(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.up]


def pick_decode(pool: Pool, exclude: set[str] | frozenset[str] = frozenset(),
                prefill_revisions: set[str] | frozenset[str] | None = None) -> Worker | None:
    """The live decode worker with the most free KV blocks (then the fewest requests), skipping
    `exclude` (workers that just refused this request). With `prefill_revisions` (the revisions
    of the live prefill workers), decode workers that have a prefill peer of their own revision
    come first: in a rollout, an old decode worker whose prefill pool is gone would prefill
    every prompt itself."""
    live = [w for w in pool.live() if w.url not in exclude]
    if prefill_revisions:
        live = [w for w in live if w.revision in prefill_revisions] or live
    if not live:
        return None
    return max(live, key=lambda w: (w.free_blocks, -(w.running + w.inflight)))


AFFINITY_SLACK_TOKENS = 2048  # how much longer a queue may be and still win on prefix affinity


def rank_prefill(pool: Pool, rng: random.Random, prompt: list[int] | None = None,
                 block_size: int = 16, revision: str | None = None) -> list[Worker]:
    """Best prefill worker first, the rest as fallbacks; with `revision` (the chosen decode
    worker's), only workers of that revision: never a pair whose K/V may not fit.

    Prompts that share their first block go to the same worker (rendezvous hashing), where its
    prefix cache likely holds them, unless that worker's queue is much longer than the shortest;
    otherwise the worker with the fewest prompt tokens still to prefill (ties at random). The
    count includes prompts part-way through prefill: a worker in the middle of a long prompt is
    busy, though its waiting queue is empty. All workers are compared, not two at random: this
    router adds what it sends to the count at once, so its own picks do not herd, and two
    random choices left queues uneven enough to cost a sixth of the prefill pool at the same
    TTFT in the simulator (docs/autoscaling.md).
    """
    live = [w for w in pool.live() if revision is None or w.revision == revision]
    if len(live) <= 1:
        return live
    shortest = min(w.queued_tokens for w in live)
    best = None
    if prompt is not None and len(prompt) > block_size:
        key = ",".join(map(str, prompt[:block_size]))
        home = max(live, key=lambda w: zlib.crc32(f"{w.url}|{key}".encode()))
        if home.queued_tokens <= shortest + AFFINITY_SLACK_TOKENS:
            best = home
    if best is None:
        best = rng.choice([w for w in live if w.queued_tokens == shortest])
    return [best] + sorted((w for w in live if w is not best), key=lambda w: w.queued_tokens)


def load(w: Worker) -> int:
    """Requests a worker carries or has queued, this router's picks since its last poll included."""
    return w.running + w.waiting + w.inflight


# A prefill worker is lent a request only when it carries at least this many fewer than the decode
# worker. One fewer is not enough: beside one stream, the decode worker is no bottleneck, and on
# one machine (`up --pin-cpus`) it leaves its core to the remote prefill (LLMEngine.remote_pause),
# which then runs on both cores; lent, the prompt got one (a chat's first token ~1.4x later than
# colocated's at 0.25-0.375 req/s, docs/benchmarks.md).
LEND_MARGIN = 2
# ... and only when the decode worker's step with one stream more is fitted to take at least this
# share of its ITL target: a lent stream shares the prefill worker's steps with the prompts that
# arrive after it, a document's chunks of a second and more on one AVX2 core, so lending to a
# decode worker far inside its target gains nothing and gambles the lent stream's ITL (in the heavy
# interference benchmark, three streams at ~23 ms a step: one lent stream of 31 had gaps of 1-1.8 s,
# split's ITL p99 496 ms against 114 in a run that lent none).
LEND_BUSY = 0.4


def lend_prefill(prefill: Pool, decode: Worker, exclude: set[str] | frozenset[str] = frozenset()) -> Worker | None:
    """A prefill worker to serve a whole request (prefill and decode) instead of `decode`, or None.

    On a fixed budget of cores a decode-heavy mix leaves the prefill pool idle while the decode
    pool is the bottleneck (docs/benchmarks.md: split 1+1 served 0.17x colocated's goodput at
    3 req/s of 64/128-token requests, two colocated replicas as much as colocated). So a prefill
    worker with nothing to prefill (no prompt queued or part-way, this router's own picks since
    the last poll included) takes the request when it carries LEND_MARGIN fewer requests than
    the decode worker picked for it, or more, and the decode worker's next step is fitted to take
    LEND_BUSY of its ITL target or more (where it reports both); otherwise the decode worker keeps it.
    A lent stream shares the prefill worker's steps with the remote prefills that arrive after it,
    as a colocated engine's streams share theirs with prompts: that is the price, and why only an
    idle worker is lent. The prompt it adds counts as queued there, so remote prefills rank it
    behind idler workers and the next lend waits for a poll that finds it idle again.
    """
    if decode.itl_target_s and decode.next_step_s is not None and decode.next_step_s < LEND_BUSY * decode.itl_target_s:
        return None  # the decode worker is no bottleneck
    idle = [w for w in prefill.live() if w.takes_requests and w.queued_tokens == 0 and w.url not in exclude]
    if not idle:
        return None
    best = min(idle, key=load)
    return best if load(best) + LEND_MARGIN <= load(decode) else None


def missing_phase(decode: Pool, prefill: Pool, need_prefill: bool,
                  exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
    """The phase a request must wait for, or None when it can be routed now.

    A request always needs a live decode worker (outside `exclude`, those that just refused it).
    It needs a live prefill worker only where the decode workers may not prefill it themselves
    (`need_prefill`: the operator sets it when prefill can scale to zero and local prefill is
    off); otherwise a decode worker given no prefill worker prefills locally, as ever.
    """
    if not any(w.url not in exclude for w in decode.live()):
        return "decode"
    if need_prefill and not prefill.live():
        return "prefill"
    return None
