"""Discrete-event model of router → prefill pool → KV transfer → decode pool.

Request flow mirrors the runtime (docs/DESIGN): the router picks the decode replica with the
most free KV and reserves the request's blocks there (prompt + output; requests wait at the
router when no replica has room), then hands the prompt to a prefill replica. Prefill binding
is late by default: the router keeps one FCFS queue and gives a prompt to the replica with the
fewest queued tokens only while that replica holds less than `dispatch_cap_tokens` (about one
chunk budget: enough that a replica never idles between prompts, little enough that a backlog
stays at the router). A backlog then drains on every ready replica, including ones that became
ready after it formed, instead of staying bound to the replicas it was dispatched to.
`dispatch_cap_tokens=None` binds at arrival (the older model: fewest queued tokens, no cap).
Prefill replicas serve their queue first come first served at a fixed token rate (chunked
prefill keeps the throughput flat in the batch); the first token returns when the KV cache has
crossed the network. Decode replicas run continuous batching: every running request gains one
token per step and the step time grows with batch size and total context.

Decode is simulated per batch change, not per step: all running requests of a replica advance
together, so a virtual clock V (tokens produced per request since the replica started) plus a
heap of finishing V's gives each completion in O(log n). Within an interval between events the
step time is held at its value at the start, so context growth inside it is ignored.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from phasesplit.operator.planner.snapshot import MetricsSnapshot
from phasesplit.operator.sim.profile import SimProfile
from phasesplit.operator.sim.workload import Request


@dataclass
class Outcome:
    """One request's fate."""

    arrival: float
    isl: int
    osl: int
    first_token: float = math.nan
    done: float = math.nan

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def itl(self) -> float:
        """Mean gap between tokens (0 for single-token outputs: nothing to wait between)."""
        return (self.done - self.first_token) / (self.osl - 1) if self.osl > 1 else 0.0


@dataclass
class Replica:
    phase: str
    created: float
    ready_at: float
    removed: float | None = None
    draining: bool = False
    # prefill
    queue: deque = field(default_factory=deque)
    queued_tokens: float = 0.0  # waiting + in service
    busy: bool = False
    # decode
    reserved: float = 0.0
    v: float = 0.0
    v_at: float = 0.0
    step: float = 0.0
    ctx_base: float = 0.0  # Σ(isl_i - vjoin_i): context of the batch = ctx_base + n·v
    finishing: list = field(default_factory=list)  # heap of (target v, seq, request index)
    version: int = 0

    def ready(self, now: float) -> bool:
        return self.removed is None and not self.draining and self.ready_at <= now

    def serving(self, now: float) -> bool:
        return self.removed is None and self.ready_at <= now


# A chunked-prefill step budget: a replica holding less than this gets the next prompt.
DISPATCH_CAP_TOKENS = 2048.0

Policy = Callable[[MetricsSnapshot, dict[str, int], float], dict[str, int]]


@dataclass
class Sample:
    t: float
    arrivals_per_s: float
    prefill: int
    decode: int
    ttft_p: float | None
    itl_p: float | None


def weighted_quantile(pairs: list[tuple[float, float]], q: float) -> float | None:
    total = sum(w for _, w in pairs)
    if total <= 0:
        return None
    acc = 0.0
    for v, w in sorted(pairs):
        acc += w
        if acc >= q * total:
            return v
    return pairs[-1][0]


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Simulation:
    def __init__(self, requests: list[Request], profile: SimProfile, policy: Policy, initial: dict[str, int],
                 interval_s: float, slo_ttft: float, slo_itl: float, percentile: float = 0.95,
                 duration: float | None = None, sample_s: float = 10.0,
                 dispatch_cap_tokens: float | None = DISPATCH_CAP_TOKENS):
        self.requests = requests
        self.dispatch_cap = dispatch_cap_tokens
        self.p = profile
        self.policy = policy
        self.interval = interval_s
        self.slo = (slo_ttft, slo_itl)
        self.percentile = percentile
        self.duration = duration if duration is not None else (requests[-1].arrival if requests else 0.0)
        self.sample_s = sample_s
        self.out = [Outcome(r.arrival, r.isl, r.osl) for r in requests]
        self.replicas: list[Replica] = []
        self.events: list = []
        self.seq = 0
        self.waiting: deque[int] = deque()  # requests with no decode KV room yet
        # Late binding: prompts (with their decode reservation) not yet given to a prefill replica.
        self.pending: deque[tuple[int, Replica]] = deque()
        self.pending_tokens = 0.0
        self.samples: list[Sample] = []
        self._sample_reset()
        self._window_reset(0.0)
        self.decisions: list[tuple[float, dict[str, int], str]] = []
        for phase, n in initial.items():
            for _ in range(max(1, n)):
                self.replicas.append(Replica(phase, 0.0, 0.0))
        self.cur = {ph: max(1, n) for ph, n in initial.items()}

    # ---- event plumbing ----------------------------------------------------------------------
    def _at(self, t: float, kind: str, *payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def run(self) -> Simulation:
        for i, r in enumerate(self.requests):
            self._at(r.arrival, "arrive", i)
        t = self.interval
        while t <= self.duration + 1e-9:
            self._at(t, "tick")
            t += self.interval
        t = self.sample_s
        while t <= self.duration + 1e-9:
            self._at(t, "sample")
            t += self.sample_s
        handlers = {"arrive": self._arrive, "prefill_done": self._prefill_done, "first_token": self._first_token,
                    "decode_next": self._decode_next, "ready": self._ready, "tick": self._tick,
                    "sample": self._sample}
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](now, *payload)
        end = max(self.duration, max((o.done for o in self.out if not math.isnan(o.done)), default=0.0))
        for r in self.replicas:
            if r.removed is None:
                r.removed = end
        return self

    # ---- router ------------------------------------------------------------------------------
    def _arrive(self, now: float, i: int) -> None:
        o = self.out[i]
        self.w_arrivals += 1
        self.w_prompt += o.isl
        self.s_arrivals += 1
        self.waiting.append(i)
        self._admit(now)

    def _admit(self, now: float) -> None:
        """Reserve decode KV for waiting requests in order (head-of-line: no overtaking)."""
        while self.waiting:
            i = self.waiting[0]
            need = self.out[i].isl + self.out[i].osl
            best = None
            for r in self.replicas:
                if r.phase == "decode" and r.ready(now):
                    free = self.p.kv_capacity_tokens - r.reserved
                    if free >= need and (best is None or free > self.p.kv_capacity_tokens - best.reserved):
                        best = r
            if best is None:
                # A request bigger than an empty replica can never fit: let it through on an empty
                # replica rather than block the line forever (the runtime would reject it).
                empty = [r for r in self.replicas if r.phase == "decode" and r.ready(now) and r.reserved == 0]
                if not empty or need <= self.p.kv_capacity_tokens:
                    return
                best = empty[0]
            self.waiting.popleft()
            best.reserved += need
            self._to_prefill(now, i, best)

    def _to_prefill(self, now: float, i: int, decode: Replica) -> None:
        self.pending.append((i, decode))
        self.pending_tokens += self.out[i].isl
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        """Give queued prompts, in order, to prefill replicas that have room under the cap."""
        while self.pending:
            pool = [r for r in self.replicas if r.phase == "prefill" and r.ready(now)]
            if not pool:  # every prefill replica draining or starting: use one that is serving
                pool = [r for r in self.replicas if r.phase == "prefill" and r.serving(now)]
            if not pool:
                return
            r = min(pool, key=lambda x: x.queued_tokens)
            # An empty replica always takes the prompt (one longer than the cap must go somewhere).
            if self.dispatch_cap is not None and r.queued_tokens > 0 and r.queued_tokens >= self.dispatch_cap:
                return
            i, decode = self.pending.popleft()
            isl = self.out[i].isl
            self.pending_tokens -= isl
            r.queued_tokens += isl
            r.queue.append((i, decode))
            if not r.busy:
                self._start_prefill(now, r)

    # ---- prefill -----------------------------------------------------------------------------
    def _start_prefill(self, now: float, r: Replica) -> None:
        i, decode = r.queue[0]
        r.busy = True
        self._at(now + self.p.prefill_overhead_s + self.out[i].isl / self.p.prefill_tokens_per_s,
                 "prefill_done", r, i, decode)

    def _prefill_done(self, now: float, r: Replica, i: int, decode: Replica) -> None:
        r.queue.popleft()
        r.queued_tokens -= self.out[i].isl
        r.busy = False
        self._dispatch(now)  # room under the cap again: the router's queue moves on
        if r.queue and not r.busy:
            self._start_prefill(now, r)
        elif not r.queue and r.draining:
            r.removed = now
        # KV leaves layer by layer while later layers compute, so only the part of the transfer
        # that outlasts the compute (at least the last layer's share) delays the first token.
        isl = self.out[i].isl
        total = isl * self.p.kv_bytes_per_token / self.p.transfer_bytes_per_s
        compute = isl / self.p.prefill_tokens_per_s
        exposed = self.p.transfer_latency_s + max(total - compute, total / self.p.layers)
        self._at(now + exposed, "first_token", i, decode)

    def _first_token(self, now: float, i: int, decode: Replica) -> None:
        o = self.out[i]
        o.first_token = now
        self.w_ttft.append(o.ttft)
        self.s_ttft.append(o.ttft)
        self.w_gen += 1
        if o.osl <= 1:
            self._finish(now, i, decode)
            return
        self._advance(now, decode)
        target = decode.v + (o.osl - 1)
        heapq.heappush(decode.finishing, (target, i))
        decode.ctx_base += o.isl - decode.v
        self._reschedule(now, decode)

    # ---- decode ------------------------------------------------------------------------------
    def _step_time(self, r: Replica) -> float:
        n = len(r.finishing)
        ctx = r.ctx_base + n * r.v
        return self.p.decode_base_s + self.p.decode_per_seq_s * n + self.p.decode_per_token_s * ctx

    def _advance(self, now: float, r: Replica) -> None:
        n = len(r.finishing)
        if n and now > r.v_at:
            dt = now - r.v_at
            steps = dt / r.step
            r.v += steps
            self.w_itl.append((r.step, n * steps))
            self.s_itl.append((r.step, n * steps))
            self.w_gen += n * steps
        r.v_at = now

    def _reschedule(self, now: float, r: Replica) -> None:
        r.version += 1
        if r.finishing:
            r.step = self._step_time(r)
            target = r.finishing[0][0]
            self._at(now + max(0.0, target - r.v) * r.step, "decode_next", r, r.version)

    def _decode_next(self, now: float, r: Replica, version: int) -> None:
        if version != r.version:
            return
        self._advance(now, r)
        while r.finishing and r.finishing[0][0] <= r.v + 1e-6:
            target, i = heapq.heappop(r.finishing)
            o = self.out[i]
            r.ctx_base -= o.isl - (target - (o.osl - 1))
            self._finish(now, i, r)
        self._reschedule(now, r)

    def _finish(self, now: float, i: int, r: Replica) -> None:
        o = self.out[i]
        o.done = now
        r.reserved -= o.isl + o.osl
        self.w_done.append(i)
        if r.draining and not r.finishing and r.reserved <= 0:
            r.removed = now
        self._admit(now)

    # ---- scaling -----------------------------------------------------------------------------
    def _ready(self, now: float, r: Replica) -> None:
        if r.removed is None:
            self._admit(now)
            self._dispatch(now)  # a new prefill replica takes its share of the router's backlog

    def _scale(self, now: float, phase: str, desired: int) -> None:
        desired = max(1, desired)
        live = [r for r in self.replicas if r.phase == phase and r.removed is None and not r.draining]
        if desired > len(live):
            for _ in range(desired - len(live)):
                r = Replica(phase, now, now + self.p.startup_s)
                self.replicas.append(r)
                self._at(r.ready_at, "ready", r)
        elif desired < len(live):
            # Remove pods still starting first, then the least loaded; drain, never drop work.
            def load(r: Replica) -> tuple:
                return (r.ready_at <= now, r.queued_tokens if phase == "prefill" else r.reserved)
            for r in sorted(live, key=load)[: len(live) - desired]:
                if r.ready_at > now or (phase == "prefill" and not r.busy) or \
                        (phase == "decode" and not r.finishing and r.reserved <= 0):
                    r.removed = now
                else:
                    r.draining = True
        self.cur[phase] = desired

    def _tick(self, now: float) -> None:
        snap = self.snapshot(now)
        self._window_reset(now)
        desired = self.policy(snap, dict(self.cur), now)
        for phase in ("prefill", "decode"):
            if desired[phase] != self.cur[phase]:
                self._scale(now, phase, desired[phase])

    # ---- metrics -----------------------------------------------------------------------------
    def _window_reset(self, now: float) -> None:
        self.w_start = now
        self.w_arrivals = 0
        self.w_prompt = 0
        self.w_gen = 0.0
        self.w_ttft: list[float] = []
        self.w_itl: list[tuple[float, float]] = []
        self.w_done: list[int] = []

    def _sample_reset(self) -> None:
        self.s_arrivals = 0
        self.s_ttft: list[float] = []
        self.s_itl: list[tuple[float, float]] = []

    def snapshot(self, now: float) -> MetricsSnapshot:
        """What a router and the workers' /metrics would show for the window ending now."""
        for r in self.replicas:
            if r.phase == "decode" and r.serving(now):
                self._advance(now, r)
        window = now - self.w_start
        pre = [r for r in self.replicas if r.phase == "prefill" and r.serving(now)]
        dec = [r for r in self.replicas if r.phase == "decode" and r.serving(now)]
        ttft_ok, itl_ok = self.slo
        met = sum(1 for i in self.w_done if self.out[i].ttft <= ttft_ok and self.out[i].itl <= itl_ok)
        # The runtime's request-size histograms observe at arrival (prompt) and at the end (output).
        osl_mean = sum(self.out[i].osl for i in self.w_done) / len(self.w_done) if self.w_done else None
        return MetricsSnapshot(
            timestamp=now, window_s=window,
            request_rate=self.w_arrivals / window,
            prompt_token_rate=self.w_prompt / window,
            generation_token_rate=self.w_gen / window,
            ttft_p=quantile(self.w_ttft, self.percentile),
            ttft_mean=sum(self.w_ttft) / len(self.w_ttft) if self.w_ttft else None,
            itl_p=weighted_quantile(self.w_itl, self.percentile),
            itl_mean=(sum(s * w for s, w in self.w_itl) / sum(w for _, w in self.w_itl))
            if self.w_itl and sum(w for _, w in self.w_itl) > 0 else None,
            # The router's own queue (late binding) is prefill work waiting too; the router
            # exports it beside the replicas' queues.
            prefill_queue_tokens=self.pending_tokens
            + sum(r.queued_tokens - (self.out[r.queue[0][0]].isl if r.busy else 0) for r in pre),
            prefill_waiting=float(len(self.pending) + sum(max(0, len(r.queue) - 1) for r in pre)),
            decode_running=float(sum(len(r.finishing) for r in dec)),
            decode_waiting=float(len(self.waiting)),
            kv_usage=sum(r.reserved for r in dec) / (len(dec) * self.p.kv_capacity_tokens) if dec else None,
            slo_attainment=met / len(self.w_done) if self.w_done else None,
            ready_prefill=len(pre), ready_decode=len(dec),
            prompt_tokens_mean=self.w_prompt / self.w_arrivals if self.w_arrivals else None,
            generated_tokens_mean=osl_mean,
        )

    def _sample(self, now: float) -> None:
        live = {ph: sum(1 for r in self.replicas if r.phase == ph and r.removed is None) for ph in ("prefill", "decode")}
        for r in self.replicas:
            if r.phase == "decode" and r.serving(now):
                self._advance(now, r)
        self.samples.append(Sample(now, self.s_arrivals / self.sample_s, live["prefill"], live["decode"],
                                   quantile(self.s_ttft, self.percentile),
                                   weighted_quantile(self.s_itl, self.percentile)))
        self._sample_reset()

    # ---- results -----------------------------------------------------------------------------
    def replica_seconds(self, start: float = 0.0) -> dict[str, float]:
        """Time each replica existed (starting, serving or draining) within [start, duration]."""
        out = {"prefill": 0.0, "decode": 0.0}
        for r in self.replicas:
            end = min(r.removed if r.removed is not None else self.duration, self.duration)
            out[r.phase] += max(0.0, end - max(r.created, start))
        out["total"] = out["prefill"] + out["decode"]
        return out
