"""Prometheus metrics under the names of runtime/metric_names.py (labels model and phase).

Each server process owns one registry, so several servers (or tests) in one process never clash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phasesplit.runtime import metric_names as n
from phasesplit.runtime.disagg.placement import LOCAL, OUTCOMES
from phasesplit.runtime.metric_names import (
    E2E_BUCKETS,
    HELD_BUCKETS,
    ITL_BUCKETS,
    TRANSFER_BUCKETS,
    TTFT_BUCKETS,
)

if TYPE_CHECKING:  # the router imports this module and must not load torch
    from phasesplit.runtime.engine.engine import LLMEngine
    from phasesplit.runtime.engine.scheduler import ScheduledBatch
    from phasesplit.runtime.engine.sequence import Sequence

class Metrics:
    def __init__(self, model: str, phase: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model": model, "phase": phase}
        names = ["model", "phase"]
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r)

        self.ttft = hist(n.TTFT, "Time from arrival to the first token", TTFT_BUCKETS)
        self.itl = hist(n.ITL, "Time between consecutive tokens", ITL_BUCKETS)
        self.e2e = hist(n.E2E, "Time from arrival to the last token", E2E_BUCKETS)
        self.queue = hist(n.QUEUE_TIME, "Time from arrival to first scheduling", TTFT_BUCKETS)
        self.kv_transfer = hist(n.KV_TRANSFER, "Time to move one request's KV cache", TRANSFER_BUCKETS)
        self.prompt_tokens = counter(n.PROMPT_TOKENS, "Prompt tokens of finished prefills")
        self.generation_tokens = counter(n.GENERATION_TOKENS, "Generated tokens")
        self.prefix_queries = counter(n.PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter(n.PREFIX_HITS, "Prompt tokens found in the prefix cache")
        self.preemptions = counter(n.PREEMPTIONS, "Requests preempted to free KV cache")
        self.kv_bytes = counter(n.KV_BYTES, "KV cache bytes sent or received")
        self.local_prefill = counter(n.LOCAL_PREFILL, "Decode-worker requests prefilled locally")
        self.kv_failures = counter(n.KV_TRANSFER_FAILURES,
                                   "Remote prefill attempts that failed (refused, timed out or KV stream cut)")
        self.placement = Counter(n.PREFILL_PLACEMENT, "Decode-worker prefill placement decisions",
                                 [*names, "where", "reason"], registry=r)
        self.success = Counter(n.SUCCESS, "Finished requests by reason", [*names, "finished_reason"], registry=r)
        self.running = gauge(n.RUNNING, "Requests in the running batch")
        self.waiting = gauge(n.WAITING, "Requests waiting to be scheduled")
        self.kv_usage = gauge(n.KV_USAGE, "Fraction of KV cache blocks in use (0-1)")
        self.prefill_queue = gauge(n.PREFILL_QUEUE_TOKENS, "Prompt tokens waiting to be prefilled")
        self.held = self.held_wait = self.lent = None
        if phase == "router":  # the held queue and lending (router.py) exist only there
            self.lent = counter(n.LENT_REQUESTS, "Requests sent whole to an idle prefill worker")
            self.child(self.lent)
            self.held = gauge(n.HELD, "Requests held for want of a worker (a phase at zero or not ready yet)")
            self.held_wait = hist(n.HELD_WAIT, "Time a held request waited for a worker", HELD_BUCKETS)
            self.child(self.held_wait)
        # Create every labelled series now, so scrapers see zeros instead of missing metrics.
        for metric in (self.ttft, self.itl, self.e2e, self.queue, self.kv_transfer, self.prompt_tokens,
                       self.generation_tokens, self.prefix_queries, self.prefix_hits, self.preemptions,
                       self.kv_bytes, self.local_prefill, self.kv_failures):
            self.child(metric)
        if phase == "decode":
            for where, reason in OUTCOMES:
                self.placement.labels(**self.labels, where=where, reason=reason)

    def place(self, where: str, reason: str) -> None:
        """Count one placement decision; every local one is a local prefill too."""
        self.placement.labels(**self.labels, where=where, reason=reason).inc()
        if where == LOCAL:
            self.child(self.local_prefill).inc()

    def bind(self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float],
             queue_tokens: Callable[[], float] | None = None) -> None:
        """Read the gauges from live engine state at scrape time."""
        self.running.labels(**self.labels).set_function(running)
        self.waiting.labels(**self.labels).set_function(waiting)
        self.kv_usage.labels(**self.labels).set_function(kv_usage)
        if queue_tokens is not None:
            self.prefill_queue.labels(**self.labels).set_function(queue_tokens)

    def child(self, metric):  # the labelled child of a metric
        return metric.labels(**self.labels)


class EngineMetrics:
    """Feeds engine events into the Prometheus metrics (an engine.EngineObserver)."""

    def __init__(self, metrics: Metrics, engine: LLMEngine) -> None:
        self.m = metrics
        self.engine = engine  # read for the prefix-cache and preemption counters
        self._seen_queries = 0
        self._seen_hits = 0
        self._seen_preemptions = 0

    def on_scheduled(self, seq: Sequence) -> None:
        self.m.child(self.m.queue).observe(max(0.0, (seq.first_scheduled or seq.arrival) - seq.arrival))

    def on_token(self, seq: Sequence, now: float) -> None:
        m = self.m
        m.child(m.generation_tokens).inc()
        if seq.last_token_time is None:
            m.child(m.ttft).observe(now - seq.arrival)
            m.child(m.prompt_tokens).inc(len(seq.prompt_ids))
        else:
            m.child(m.itl).observe(now - seq.last_token_time)

    def on_finished(self, seq: Sequence, now: float) -> None:
        m = self.m
        m.child(m.e2e).observe(now - seq.arrival)
        m.success.labels(**m.labels, finished_reason=seq.finish_reason or "unknown").inc()

    def on_step(self, batch: ScheduledBatch, seconds: float) -> None:
        e = self.engine
        m = self.m
        b = e.blocks
        if b.queries > self._seen_queries:
            m.child(m.prefix_queries).inc(b.queries - self._seen_queries)
            self._seen_queries = b.queries
        if b.hits > self._seen_hits:
            m.child(m.prefix_hits).inc(b.hits - self._seen_hits)
            self._seen_hits = b.hits
        p = e.scheduler.num_preemptions
        if p > self._seen_preemptions:
            m.child(m.preemptions).inc(p - self._seen_preemptions)
            self._seen_preemptions = p
