"""From raw samples of every pod (two scrapes) to the planner's MetricsSnapshot. Pure.

Which series answer which question follows the runtime's metric names (runtime/
metric_names.py): latency as the client sees it comes from the router (phase="router"), or from
colocated workers (phase="both") when there is no router; work and queues from the phase that
does the work.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from phasesplit.operator.metrics.histogram import Histogram
from phasesplit.operator.planner.snapshot import MetricsSnapshot
from phasesplit.runtime.metric_names import (
    GENERATION_TOKENS,
    HELD,
    ITL,
    KV_USAGE,
    PREFILL_QUEUE_TOKENS,
    PREFIX,
    PROMPT_TOKENS,
    RUNNING,
    SUCCESS,
    TTFT,
    WAITING,
)


@dataclass
class PodSample:
    """One pod's page: counters/gauges by (name, phase) and histograms by (name, phase)."""

    values: dict[tuple[str, str], float] = field(default_factory=dict)
    histograms: dict[tuple[str, str], Histogram] = field(default_factory=dict)


@dataclass
class Scrape:
    timestamp: float
    pods: dict[str, PodSample]  # pod name → its samples


def carry_forward(prev: Scrape | None, cur: Scrape, targets: Iterable[str]) -> Scrape:
    """cur, plus the last sample of each target that did not answer this time (a timeout on a
    busy pod). Without it the pod is "new" once it answers again and its lifetime counts land in
    that one window (seen on the real node: a router missed one scrape, and the next window read
    12 requests/s and its whole TTFT histogram while nothing arrived, so the planner never scaled
    down). A carried pod adds nothing to this window and counts from its last sample next time."""
    if prev is None:
        return cur
    missing = {n: s for n, s in prev.pods.items() if n in set(targets) and n not in cur.pods}
    return Scrape(cur.timestamp, {**missing, **cur.pods}) if missing else cur


def _phase_pods(scrape: Scrape, phase: str) -> list[PodSample]:
    return [p for p in scrape.pods.values() if any(k[1] == phase for k in p.values)
            or any(k[1] == phase for k in p.histograms)]


def _hist_delta(prev: Scrape, cur: Scrape, name: str, phase: str) -> Histogram | None:
    total = None
    for pod, sample in cur.pods.items():
        h = sample.histograms.get((name, phase))
        if h is None:
            continue
        before = prev.pods.get(pod)
        earlier = before.histograms.get((name, phase)) if before else None
        # A pod new since the last scrape: all of its counts fall in this window.
        delta = h.minus(earlier) if earlier is not None else h
        total = delta if total is None else total.add(delta)
    return total


def _counter_delta(prev: Scrape, cur: Scrape, name: str, phase: str) -> float | None:
    total, seen = 0.0, False
    for pod, sample in cur.pods.items():
        v = sample.values.get((name, phase))
        if v is None:
            continue
        seen = True
        before = prev.pods.get(pod)
        old = before.values.get((name, phase)) if before else None
        total += v - old if old is not None and v >= old else v
    return total if seen else None


def _gauge(cur: Scrape, name: str, phase: str, how: str = "sum") -> float | None:
    vals = [s.values[(name, phase)] for s in cur.pods.values() if (name, phase) in s.values]
    if not vals:
        return None
    return sum(vals) if how == "sum" else sum(vals) / len(vals)


def _first(*phases_and_values):
    for v in phases_and_values:
        if v is not None:
            return v
    return None


def attainment(ttft: Histogram | None, itl: Histogram | None, slo: tuple[float, float] | None) -> float | None:
    """Estimated share of requests meeting both targets: the share of first tokens within the
    TTFT target times the share of token gaps within the ITL target (the histograms are per
    token, not per request, and independence is assumed; an estimate for status, not a gate)."""
    if slo is None or ttft is None:
        return None
    a = ttft.fraction_within(slo[0])
    if a is None:
        return None
    b = itl.fraction_within(slo[1]) if itl is not None else None
    return a * (b if b is not None else 1.0)


def snapshot(prev: Scrape, cur: Scrape, percentile: float,
             slo: tuple[float, float] | None = None) -> MetricsSnapshot:
    window = cur.timestamp - prev.timestamp
    if window <= 0:
        raise ValueError("scrapes out of order")
    front = "router" if _phase_pods(cur, "router") else "both"
    prefill = "prefill" if _phase_pods(cur, "prefill") else "both"
    decode = "decode" if _phase_pods(cur, "decode") else "both"
    ttft = _hist_delta(prev, cur, TTFT, front)
    itl = _hist_delta(prev, cur, ITL, front)
    first_tokens = ttft.count if ttft is not None else None
    prompt = _counter_delta(prev, cur, PROMPT_TOKENS, prefill)
    generated = _counter_delta(prev, cur, GENERATION_TOKENS, decode)
    finished = _counter_delta(prev, cur, SUCCESS, front)
    if finished is None:
        finished = _counter_delta(prev, cur, SUCCESS, decode)
    # Requests per second: first tokens seen at the front end. Requests still queued show up
    # in the queue gauges instead, which the planner reads as backlog.
    rate = first_tokens / window if first_tokens is not None else None
    return MetricsSnapshot(
        timestamp=cur.timestamp,
        window_s=window,
        request_rate=rate,
        prompt_token_rate=prompt / window if prompt is not None else None,
        generation_token_rate=generated / window if generated is not None else None,
        ttft_p=ttft.quantile(percentile) if ttft else None,
        ttft_mean=ttft.mean() if ttft else None,
        itl_p=itl.quantile(percentile) if itl else None,
        itl_mean=itl.mean() if itl else None,
        prefill_queue_tokens=_gauge(cur, PREFILL_QUEUE_TOKENS, prefill),
        prefill_waiting=_gauge(cur, WAITING, prefill) if prefill != decode else None,
        decode_running=_gauge(cur, RUNNING, decode),
        decode_waiting=_gauge(cur, WAITING, decode),
        kv_usage=_gauge(cur, KV_USAGE, decode, "mean"),
        slo_attainment=attainment(ttft, itl, slo),
        ttft_attainment=attainment(ttft, None, slo),
        ready_prefill=len(_phase_pods(cur, prefill)) or None,
        ready_decode=len(_phase_pods(cur, decode)) or None,
        # Prompt tokens are counted when the first token is out (runtime/server/metrics.py), so
        # per first token they give the mean prompt; output tokens per finished request.
        prompt_tokens_mean=prompt / first_tokens if prompt is not None and first_tokens else None,
        generated_tokens_mean=generated / finished if generated is not None and finished else None,
        # Requests the router holds for want of a worker (a phase at zero): they wake the phases.
        held_requests=_gauge(cur, HELD, "router"),
    )


def merge_families(families, pod: str) -> PodSample:
    """prometheus_client.parser families → one PodSample (only phasesplit_ series)."""
    out = PodSample()
    hist: dict[tuple[str, str], Histogram] = defaultdict(Histogram)
    for fam in families:
        for s in fam.samples:
            if not s.name.startswith(PREFIX):
                continue
            phase = s.labels.get("phase", "")
            if fam.type == "histogram":
                h = hist[(fam.name, phase)]
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    h.buckets[le] = h.buckets.get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    h.total += s.value
                elif s.name.endswith("_count"):
                    h.count += s.value
            elif fam.type in ("counter", "gauge", "unknown"):
                if s.name.endswith("_created"):
                    continue
                key = (s.name, phase)
                out.values[key] = out.values.get(key, 0.0) + s.value
    out.histograms = dict(hist)
    return out
