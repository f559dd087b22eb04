"""Metrics → snapshot: histogram deltas and quantiles, aggregation across pods, PromQL text.

Pages are produced by a real prometheus_client registry and parsed by its real parser."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phasesplit.operator.metrics.aggregate import Scrape, carry_forward, merge_families, snapshot
from phasesplit.operator.metrics.histogram import Histogram as H
from phasesplit.operator.metrics.prometheus import queries
from phasesplit.runtime import metric_names as names

BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5)


class Pod:
    """One runtime process's metrics, with the runtime's names and labels."""

    def __init__(self, phase: str, model: str = "m"):
        self.r = CollectorRegistry()
        self.labels = {"model": model, "phase": phase}
        labels = ["model", "phase"]
        self.ttft = Histogram(names.TTFT, "", labels, buckets=BUCKETS, registry=self.r)
        self.itl = Histogram(names.ITL, "", labels, buckets=BUCKETS, registry=self.r)
        self.prompt = Counter(names.PROMPT_TOKENS, "", labels, registry=self.r)
        self.gen = Counter(names.GENERATION_TOKENS, "", labels, registry=self.r)
        self.success = Counter(names.SUCCESS, "", [*labels, "finished_reason"], registry=self.r)
        self.running = Gauge(names.RUNNING, "", labels, registry=self.r)
        self.waiting = Gauge(names.WAITING, "", labels, registry=self.r)
        self.kv = Gauge(names.KV_USAGE, "", labels, registry=self.r)
        self.queue = Gauge(names.PREFILL_QUEUE_TOKENS, "", labels, registry=self.r)
        for g in (self.running, self.waiting, self.kv, self.queue):
            g.labels(**self.labels).set(0)

    def c(self, metric):
        return metric.labels(**self.labels)

    def page(self, name: str):
        text = generate_latest(self.r).decode()
        return merge_families(text_string_to_metric_families(text), name)


def scrape(t: float, pods: dict[str, Pod]) -> Scrape:
    return Scrape(t, {n: p.page(n) for n, p in pods.items()})


def test_quantile_interpolates_like_histogram_quantile():
    h = H({0.1: 10, 0.5: 50, 1.0: 90, float("inf"): 100}, total=0, count=100)
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * (50 - 10) / 40)
    assert h.quantile(0.9) == pytest.approx(1.0)
    assert h.quantile(0.95) == 1.0  # in +Inf: the highest finite bound
    assert H().quantile(0.5) is None


def test_window_quantile_uses_deltas_not_lifetime():
    router = Pod("router")
    for _ in range(1000):
        router.c(router.ttft).observe(0.05)  # an hour of fast history
    before = scrape(0, {"r": router})
    for _ in range(50):
        router.c(router.ttft).observe(2.0)  # the last window is slow
    snap = snapshot(before, scrape(30, {"r": router}), 0.95)
    assert snap.ttft_p > 1.0 and snap.ttft_mean == pytest.approx(2.0)
    # The lifetime view would have called this window healthy.
    lifetime = router.page("r").histograms[(names.TTFT, "router")]
    assert lifetime.quantile(0.95) < 0.5


def test_ttft_attainment_is_the_windows_share_of_first_tokens_within_the_target():
    # What the planner's clump memory reads: the window's TTFT misses, apart from ITL's.
    router = Pod("router")
    for _ in range(1000):
        router.c(router.ttft).observe(2.0)  # slow history is not this window's
    before = scrape(0, {"r": router})
    for i in range(100):
        router.c(router.ttft).observe(0.2 if i < 96 else 0.8)
        router.c(router.itl).observe(2.0)  # every token gap misses ITL: not a TTFT miss
    snap = snapshot(before, scrape(15, {"r": router}), 0.95, slo=(0.5, 0.1))
    assert snap.ttft_attainment == pytest.approx(0.96)
    assert snap.slo_attainment == pytest.approx(0.0)
    assert snapshot(before, scrape(15, {"r": router}), 0.95).ttft_attainment is None  # no SLO given


def test_split_pods_aggregate_by_phase():
    router, p1, p2, d1 = Pod("router"), Pod("prefill"), Pod("prefill"), Pod("decode")
    pods = {"router": router, "p1": p1, "p2": p2, "d1": d1}
    before = scrape(100, pods)
    for _ in range(60):
        router.c(router.ttft).observe(0.2)
        router.c(router.itl).observe(0.02)
    p1.c(p1.prompt).inc(30 * 800)
    p2.c(p2.prompt).inc(30 * 800)
    d1.c(d1.gen).inc(40 * 100)
    d1.success.labels(**d1.labels, finished_reason="stop").inc(40)
    p1.c(p1.queue).set(1500)
    p2.c(p2.queue).set(500)
    d1.c(d1.running).set(12)
    d1.c(d1.waiting).set(3)
    d1.c(d1.kv).set(0.4)
    s = snapshot(before, scrape(130, pods), 0.95)
    assert s.window_s == 30
    assert s.request_rate == pytest.approx(2.0)
    assert s.prompt_token_rate == pytest.approx(1600)
    assert s.mean_prompt_tokens == pytest.approx(800)
    assert s.mean_generated_tokens == pytest.approx(100)
    assert s.prefill_queue_tokens == 2000 and s.decode_running == 12 and s.decode_waiting == 3
    assert s.kv_usage == pytest.approx(0.4)
    assert (s.ready_prefill, s.ready_decode) == (2, 1)
    assert 0.1 < s.ttft_p <= 0.25 and 0.0 < s.itl_p <= 0.1


def test_colocated_pods_answer_for_every_phase():
    both = Pod("both")
    before = scrape(0, {"w": both})
    for _ in range(10):
        both.c(both.ttft).observe(0.3)
    both.c(both.prompt).inc(5000)
    both.c(both.running).set(4)
    s = snapshot(before, scrape(10, {"w": both}), 0.9)
    assert s.request_rate == pytest.approx(1.0) and s.mean_prompt_tokens == pytest.approx(500)
    assert s.decode_running == 4 and s.ready_prefill == 1 and s.ready_decode == 1


def test_a_pod_that_missed_a_scrape_is_not_counted_whole_when_it_answers_again():
    router, d1 = Pod("router"), Pod("decode")
    for _ in range(122):
        router.c(router.ttft).observe(2.0)
    first = scrape(0, {"router": router, "d1": d1})
    # The router times out on the next scrape: its last sample stands in, adding nothing.
    missed = carry_forward(first, scrape(5, {"d1": d1}), ["router", "d1"])
    assert snapshot(first, missed, 0.9).request_rate == 0
    # It answers again with nothing new: still no traffic (not 122 requests in one window).
    back = carry_forward(missed, scrape(10, {"router": router, "d1": d1}), ["router", "d1"])
    assert snapshot(missed, back, 0.9).request_rate == 0
    # A pod no longer among the targets is not carried.
    assert "router" not in carry_forward(first, scrape(5, {"d1": d1}), ["d1"]).pods


def test_restarted_pod_counts_from_zero_and_new_pod_counts_whole():
    old = Pod("router")
    for _ in range(100):
        old.c(old.ttft).observe(0.05)
    before = scrape(0, {"r": old})
    fresh = Pod("router")  # same pod name, counters restarted
    for _ in range(5):
        fresh.c(fresh.ttft).observe(0.05)
    newcomer = Pod("router")
    for _ in range(5):
        newcomer.c(newcomer.ttft).observe(0.05)
    s = snapshot(before, scrape(10, {"r": fresh, "r2": newcomer}), 0.5)
    assert s.request_rate == pytest.approx(1.0)  # 5 + 5 in 10 s, never negative


def test_promql_reads_window_quantiles_from_router_buckets():
    q = queries("llama", 30, 0.95, 'namespace="prod"')
    assert q["ttft_p"] == (f'histogram_quantile(0.95, sum by (le) (rate({names.TTFT}_bucket'
                           '{model="llama",phase="router",namespace="prod"}[30s])))')
    assert 'phase="prefill"' in q["prompt_token_rate"] and "rate(" in q["prompt_token_rate"]
    assert q["kv_usage"].startswith(f"avg({names.KV_USAGE}{{") and 'phase="decode"' in q["kv_usage"]
    colocated = queries("llama", 30, 0.95, front="both", prefill="both", decode="both")
    assert 'phase="router"' not in "".join(colocated.values())


def test_held_requests_come_from_the_routers_page_even_with_both_phases_at_zero():
    """At zero only the router answers scrapes: its held count (the real router Metrics) is the
    snapshot's held_requests, the demand that wakes the phases."""
    from phasesplit.runtime.server.metrics import Metrics

    router = Metrics("m", "router")
    held = {"n": 0}
    router.child(router.held).set_function(lambda: held["n"])

    def page(t: float) -> Scrape:
        text = generate_latest(router.registry).decode()
        return Scrape(t, {"router-0": merge_families(text_string_to_metric_families(text), "router-0")})

    before = page(0)
    held["n"] = 3
    s = snapshot(before, page(15), 0.9)
    assert s.held_requests == 3 and s.request_rate == 0 and s.ready_prefill is None and s.ready_decode is None
    assert names.HELD in queries("m", 15, 0.9)["held_requests"]
    # Workers export no held count (only the router holds requests).
    assert Metrics("m", "decode").held is None
