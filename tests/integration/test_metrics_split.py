"""The pod-scrape metrics source against a real split deployment (router, prefill and decode
workers as separate processes): the planner's snapshot must attribute latency to the router,
prompt work to prefill, and generation and KV to decode, as the planner sizes them."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from phasesplit.operator.metrics.scrape import PodScrapeSource
from tests.integration.test_split import start_split

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    procs = start_split(tmp_path_factory.mktemp("split-metrics"))
    yield procs
    for p in procs:
        p.stop()


def test_split_snapshot_attributes_each_number_to_its_phase(split):
    prefill, decode, router = split
    model = httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    targets = {name: p.url + "/metrics" for name, p in (("prefill", prefill), ("decode", decode), ("router", router))}

    def send(n: int) -> list[int]:
        lengths = []
        with httpx.Client(timeout=180) as c:
            for i in range(n):
                r = c.post(router.url + "/v1/completions", json={
                    "model": model, "prompt": "Scaling prefill and decode apart. " * (2 + i), "max_tokens": 5,
                    "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                lengths.append(r.json()["usage"]["prompt_tokens"])
        return lengths

    send(1)  # every labelled series exists before the window opens
    source = PodScrapeSource(percentile=0.9, slo=(5.0, 1.0))
    assert asyncio.run(source.collect(targets)) is None
    lengths = send(4)
    snap = asyncio.run(source.collect(targets))
    assert not source.errors
    assert snap.request_rate * snap.window_s == pytest.approx(4)  # first tokens seen by the router
    assert (snap.ready_prefill, snap.ready_decode) == (1, 1)
    assert snap.mean_prompt_tokens == pytest.approx(sum(lengths) / 4)  # counted by the prefill worker
    assert snap.generated_tokens_mean == pytest.approx(5)  # counted by the decode worker
    assert snap.ttft_p > 0 and snap.itl_p > 0 and snap.slo_attainment == pytest.approx(1.0)
    assert snap.ttft_attainment == pytest.approx(1.0)
    assert snap.decode_running == 0 and 0 <= snap.kv_usage <= 1 and snap.prefill_queue_tokens == 0
