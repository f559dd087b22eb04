"""Discrete-event model of router → prefill pool → KV transfer → decode pool.

Request flow mirrors the runtime (router.py, split.py, engine/scheduler.py). The router binds
each request on arrival to the decode worker with the most free KV, which queues it (head of
line) until its blocks fit, then hands the prompt to the prefill worker with the fewest prompt
tokens still to prefill. A prefill worker runs the runtime's scheduler step by step: a token
budget per step, a quarter of it first for the oldest started prompt, the rest to prompts
shortest remaining first; a step costs its tokens at the replica's rate plus a per-request
overhead for each prompt it admits. The first token returns when the KV cache has crossed the
network. Decode replicas run continuous batching: every running request gains one token per
step and the step time grows with batch size and total context.

Two departures from the runtime: the decode reservation is prompt + output up front (the
runtime reserves the prompt and grows, preempting the newest request when the cache is full;
see `_admit`), and `dispatch_cap_tokens` can model a router that holds prompts itself (late
binding: one FCFS queue, a prompt given to the least loaded replica only while it holds fewer
tokens than the cap, so a backlog drains on replicas that became ready after it formed). The
runtime's router does not do that; None (the default) binds at once, as it does.

Decode is simulated per batch change, not per step: all running requests of a replica advance
together, so a virtual clock V (tokens produced per request since the replica started) plus a
heap of finishing V's gives each completion in O(log n). Within an interval between events the
step time is held at its value at the start, so context growth inside it is ignored.
"""

from __future__ import annotations

import heapq
import math
import random
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
    held: bool = False  # waited at the router for a decode worker (its phase was at zero)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def itl(self) -> float:
        """Mean gap between tokens (0 for single-token outputs: nothing to wait between)."""
        return (self.done - self.first_token) / (self.osl - 1) if self.osl > 1 else 0.0


@dataclass(eq=False)
class Prompt:
    """A prompt bound to a prefill replica (and the decode replica holding its blocks)."""

    i: int
    decode: Replica
    left: float  # prompt tokens not computed yet
    started: bool = False


@dataclass(eq=False)
class Replica:
    phase: str
    created: float
    ready_at: float
    removed: float | None = None
    draining: bool = False
    # prefill: every prompt bound here (arrival order) and the started ones (admission order)
    prompts: list = field(default_factory=list)
    started: list = field(default_factory=list)
    queued_tokens: float = 0.0  # Σ tokens left, waiting or part-way
    busy: bool = False  # a step is being computed
    # decode
    waitq: deque = field(default_factory=deque)  # requests waiting for room to reserve their KV
    reserved: float = 0.0  # KV tokens reserved (prompt + output of every admitted request)
    v: float = 0.0
    v_at: float = 0.0
    step: float = 0.0
    ctx_base: float = 0.0  # Σ(isl_i - vjoin_i): context of the batch = ctx_base + n·v
    finishing: list = field(default_factory=list)  # heap of (target v, request index)
    version: int = 0

    def ready(self, now: float) -> bool:
        return self.removed is None and not self.draining and self.ready_at <= now

    def serving(self, now: float) -> bool:
        return self.removed is None and self.ready_at <= now

    def idle(self) -> bool:
        if self.phase == "prefill":
            return not self.prompts and not self.busy
        return not self.finishing and not self.waitq and self.reserved <= 0


# Late binding's cap (about one chunked-prefill step): a replica holding less gets the next prompt.
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
                 dispatch_cap_tokens: float | None = None):
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
        # Ties between equally loaded prefill replicas are broken at random, as in the runtime.
        self.rng = random.Random(0)
        # Late binding only: prompts (with their decode replica) not yet given to a prefill replica.
        self.pending: deque[tuple[int, Replica]] = deque()
        self.pending_tokens = 0.0
        self.samples: list[Sample] = []
        self._sample_reset()
        self._window_reset(0.0)
        self.decisions: list[tuple[float, dict[str, int], str]] = []
        # The router's own queue: requests that found no decode worker (its pool at zero) wait here
        # until one is ready, as the runtime's router holds them.
        self.held: deque[int] = deque()
        for phase, n in initial.items():
            for _ in range(n):
                self.replicas.append(Replica(phase, 0.0, 0.0))
        self.cur = dict(initial)

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
        handlers = {"arrive": self._arrive, "prefill_step": self._prefill_step, "first_token": self._first_token,
                    "decode_next": self._decode_next, "ready": self._ready,
                    "tick": self._tick, "sample": self._sample}
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](now, *payload)
        end = max(self.duration, max((o.done for o in self.out if not math.isnan(o.done)), default=0.0))
        for r in self.replicas:
            if r.removed is None:
                r.removed = end
        return self

    def _pool(self, phase: str, now: float) -> list[Replica]:
        pool = [r for r in self.replicas if r.phase == phase and r.ready(now)]
        # Every replica draining or starting: use one that still serves.
        return pool or [r for r in self.replicas if r.phase == phase and r.serving(now)]

    # ---- router ------------------------------------------------------------------------------
    def _arrive(self, now: float, i: int) -> None:
        """The runtime's router binds a request to a decode worker at once (most free KV blocks,
        then fewest requests); the worker queues it until its prompt's blocks fit."""
        o = self.out[i]
        self.w_arrivals += 1
        self.w_prompt += o.isl
        self.s_arrivals += 1
        def free(r: Replica) -> tuple[float, float]:
            queued = sum(self.out[j].isl + self.out[j].osl for j in r.waitq)
            return (self.p.kv_capacity_tokens - r.reserved - queued, -(len(r.finishing) + len(r.waitq)))
        pool = self._pool("decode", now)
        if not pool:
            o.held = True
            self.held.append(i)
            return
        best = max(pool, key=free)
        best.waitq.append(i)
        self._admit(now, best)

    def _release_held(self, now: float) -> None:
        """A decode worker is up: the held requests go to it (and to any others up) in order."""
        held, self.held = self.held, deque()
        for i in held:
            self.w_arrivals -= 1  # counted once, at arrival
            self.w_prompt -= self.out[i].isl
            self.s_arrivals -= 1
            self._arrive(now, i)

    def _admit(self, now: float, r: Replica) -> None:
        """Reserve KV for waiting requests in order (head-of-line, as the decode worker's
        `_reserve_remote`). The runtime reserves the prompt's blocks and grows them as tokens
        come, preempting the newest request (to recompute it) when the cache is full; this
        model reserves prompt + output up front and never preempts (see docs/autoscaling.md)."""
        cap = self.p.kv_capacity_tokens
        while r.waitq:
            i = r.waitq[0]
            need = self.out[i].isl + self.out[i].osl
            # A request bigger than an empty replica can never fit: let it through rather than
            # block the line forever (the runtime would have rejected it).
            if r.reserved + need > cap and r.reserved > 0:
                return
            r.waitq.popleft()
            r.reserved += need
            self._to_prefill(now, i, r)

    def _to_prefill(self, now: float, i: int, decode: Replica) -> None:
        if self.dispatch_cap is not None:
            self.pending.append((i, decode))
            self.pending_tokens += self.out[i].isl
            self._dispatch(now)
            return
        pool = self._pool("prefill", now)
        if not pool:
            self.pending.append((i, decode))
            self.pending_tokens += self.out[i].isl
            return
        # The runtime's rank_prefill: fewest prompt tokens still to prefill, part-way ones included.
        least = min(r.queued_tokens for r in pool)
        self._bind(now, self.rng.choice([r for r in pool if r.queued_tokens == least]), i, decode)

    @staticmethod
    def _waiting_tokens(r: Replica) -> float:
        return sum(p.left for p in r.prompts if not p.started)

    def _bind(self, now: float, r: Replica, i: int, decode: Replica) -> None:
        isl = self.out[i].isl
        r.prompts.append(Prompt(i, decode, float(isl)))
        r.queued_tokens += isl
        self._start_step(now, r)

    def _dispatch(self, now: float) -> None:
        """Late binding (or no prefill replica at all yet): give queued prompts, in order, to the
        replica with the fewest queued tokens while it holds less than the cap."""
        while self.pending:
            pool = self._pool("prefill", now)
            if not pool:
                return
            r = min(pool, key=lambda x: x.queued_tokens)
            # An empty replica always takes the prompt (one longer than the cap must go somewhere).
            if self.dispatch_cap is not None and r.queued_tokens > 0 and r.queued_tokens >= self.dispatch_cap:
                return
            i, decode = self.pending.popleft()
            self.pending_tokens -= self.out[i].isl
            self._bind(now, r, i, decode)

    # ---- prefill -----------------------------------------------------------------------------
    def _start_step(self, now: float, r: Replica) -> None:
        """One engine step of the runtime's scheduler on a prefill worker: a token budget; the
        oldest started prompt first gets a quarter of it, then prompts shortest remaining first
        (started or waiting alike, FIFO on ties); the step costs its tokens at the replica's rate
        plus the per-request overhead of the prompts it admits."""
        if r.busy or not r.prompts:
            return
        budget = self.p.prefill_chunk_tokens
        grants: dict[Prompt, float] = {}
        partial = [p for p in r.started if p.left > 0]
        if partial:
            first = partial[0]
            grants[first] = min(first.left, max(1, budget // 4), budget)
            budget -= grants[first]
        admitted = 0
        waiting = [p for p in r.prompts if not p.started]
        for p in sorted(partial + waiting, key=lambda p: p.left):
            if budget <= 0:
                break
            if p.started:
                extra = min(p.left - grants.get(p, 0.0), budget)
                if extra > 0:
                    grants[p] = grants.get(p, 0.0) + extra
                    budget -= extra
                continue
            if len(r.started) >= self.p.max_batch:
                break
            p.started = True
            r.started.append(p)
            grants[p] = min(p.left, budget)
            budget -= grants[p]
            admitted += 1
        r.busy = True
        took = sum(grants.values()) / self.p.prefill_tokens_per_s + admitted * self.p.prefill_overhead_s
        self._at(now + took, "prefill_step", r, list(grants.items()))

    def _prefill_step(self, now: float, r: Replica, grants: list[tuple[Prompt, float]]) -> None:
        r.busy = False
        done = []
        for p, g in grants:
            p.left -= g
            r.queued_tokens -= g
            if p.left <= 1e-9:
                done.append(p)
        if done:
            r.prompts = [p for p in r.prompts if p.left > 1e-9]
            r.started = [p for p in r.started if p.left > 1e-9]
        self._start_step(now, r)
        self._dispatch(now)  # late binding: room under the cap again
        if r.draining and r.idle():
            r.removed = now
        for p in done:
            self.w_prefilled += self.out[p.i].isl
            # KV leaves layer by layer while later layers compute, so only the part of the transfer
            # that outlasts the compute (at least the last layer's share) delays the first token.
            isl = self.out[p.i].isl
            total = isl * self.p.kv_bytes_per_token / self.p.transfer_bytes_per_s
            compute = isl / self.p.prefill_tokens_per_s
            exposed = self.p.transfer_latency_s + max(total - compute, total / self.p.layers)
            self._at(now + exposed, "first_token", p.i, p.decode)

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
        heapq.heappush(decode.finishing, (decode.v + (o.osl - 1), i))
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
        self._admit(now, r)
        if r.draining and r.removed is None and r.idle():
            r.removed = now

    # ---- scaling -----------------------------------------------------------------------------
    def _ready(self, now: float, r: Replica) -> None:
        if r.removed is None:
            if r.phase == "decode" and self.held:
                self._release_held(now)
            self._dispatch(now)  # prompts held for want of a prefill replica (or late binding)

    def _scale(self, now: float, phase: str, desired: int) -> None:
        desired = max(0, desired)
        live = [r for r in self.replicas if r.phase == phase and r.removed is None and not r.draining]
        if desired > len(live):
            for _ in range(desired - len(live)):
                r = Replica(phase, now, now + self.p.startup(phase))
                self.replicas.append(r)
                self._at(r.ready_at, "ready", r)
        elif desired < len(live):
            # Remove pods still starting first, then the least loaded; drain, never drop work.
            def load(r: Replica) -> tuple:
                if phase == "prefill":
                    return (r.ready_at <= now, r.queued_tokens)
                return (r.ready_at <= now, r.reserved + sum(self.out[j].isl + self.out[j].osl for j in r.waitq))
            for r in sorted(live, key=load)[: len(live) - desired]:
                if r.ready_at > now or r.idle():
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
        self.w_prefilled = 0
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
            # The runtime counts prompt tokens as their prefills finish (server/metrics.py), not as
            # they arrive: a saturated pool's counter advances at its capacity, which the planner
            # learns from (model.bound_prefill); counted at arrival here, it read as a slow pool.
            prompt_token_rate=self.w_prefilled / window,
            generation_token_rate=self.w_gen / window,
            ttft_p=quantile(self.w_ttft, self.percentile),
            ttft_mean=sum(self.w_ttft) / len(self.w_ttft) if self.w_ttft else None,
            itl_p=weighted_quantile(self.w_itl, self.percentile),
            itl_mean=(sum(s * w for s, w in self.w_itl) / sum(w for _, w in self.w_itl))
            if self.w_itl and sum(w for _, w in self.w_itl) > 0 else None,
            # The router's own queue (late binding) is prefill work waiting too; the router
            # exports it beside the replicas' queues.
            # The workers' queues count prompts not started (the runtime's `waiting_tokens`).
            prefill_queue_tokens=self.pending_tokens + sum(self._waiting_tokens(r) for r in pre),
            prefill_waiting=float(len(self.pending) + sum(1 for r in pre for p in r.prompts if not p.started)),
            decode_running=float(sum(len(r.finishing) for r in dec)),
            decode_waiting=float(sum(len(r.waitq) for r in dec)),
            kv_usage=sum(r.reserved for r in dec) / (len(dec) * self.p.kv_capacity_tokens) if dec else None,
            slo_attainment=met / len(self.w_done) if self.w_done else None,
            ttft_attainment=sum(1 for t in self.w_ttft if t <= ttft_ok) / len(self.w_ttft) if self.w_ttft else None,
            ready_prefill=len(pre), ready_decode=len(dec),
            held_requests=float(len(self.held)),
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
