"""Scrape the pods' /metrics pages directly (the default: nothing else to install)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from phasesplit.operator.metrics.aggregate import PodSample, Scrape, carry_forward, merge_families, snapshot
from phasesplit.operator.planner.snapshot import MetricsSnapshot


async def _one(client: httpx.AsyncClient, name: str, url: str) -> tuple[str, PodSample | None, str | None]:
    try:
        r = await client.get(url)
        r.raise_for_status()
        return name, merge_families(text_string_to_metric_families(r.text), name), None
    except (httpx.HTTPError, ValueError) as e:
        return name, None, f"{name}: {type(e).__name__}: {e}"


async def scrape(targets: Mapping[str, str], timeout_s: float = 5.0,
                 client: httpx.AsyncClient | None = None) -> tuple[Scrape, list[str]]:
    """Fetch every target's page concurrently. Returns the scrape and the errors (pods that
    did not answer are left out: a pod that is not ready reports nothing, like Prometheus's up=0)."""
    own = client is None
    client = client or httpx.AsyncClient(timeout=timeout_s)
    try:
        results = await asyncio.gather(*(_one(client, n, u) for n, u in targets.items()))
    finally:
        if own:
            await client.aclose()
    pods = {n: s for n, s, _ in results if s is not None}
    return Scrape(time.time(), pods), [e for _, _, e in results if e]


class PodScrapeSource:
    """Keeps the previous scrape; each collect() returns the window since then.

    The first call only primes (there is no window yet) and returns None, which the planner
    treats as missing metrics: it holds the count.
    """

    def __init__(self, percentile: float, timeout_s: float = 5.0, slo: tuple[float, float] | None = None):
        self.percentile = percentile
        self.slo = slo
        self.timeout_s = timeout_s
        self.previous: Scrape | None = None
        self.errors: list[str] = []

    async def collect(self, targets: Mapping[str, str],
                      client: httpx.AsyncClient | None = None) -> MetricsSnapshot | None:
        """client: a shared one (the operator's planner loop keeps one for every service)."""
        cur, self.errors = await scrape(targets, self.timeout_s, client)
        cur = carry_forward(self.previous, cur, targets)
        prev, self.previous = self.previous, cur
        if prev is None or not cur.pods:
            return None
        return snapshot(prev, cur, self.percentile, self.slo)
