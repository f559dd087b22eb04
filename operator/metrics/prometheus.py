"""Read the same numbers from a Prometheus server with PromQL.

Latency quantiles are histogram_quantile over rate() of the router's buckets (the window's
distribution, not the lifetime's); token and request rates are rate() of the counters; queue
and KV figures are instant gauges. `selector` scopes every series to one InferenceService
(e.g. 'namespace="prod",service=~"chat-.*"'); the model label is always matched.
"""

from __future__ import annotations

import time

import httpx

from phasesplit.operator.metrics.aggregate import attainment
from phasesplit.operator.metrics.histogram import Histogram
from phasesplit.operator.planner.snapshot import MetricsSnapshot
from phasesplit.runtime import metric_names as names


class PrometheusError(RuntimeError):
    pass


def queries(model: str, window_s: float, percentile: float, selector: str = "",
            front: str = "router", prefill: str = "prefill", decode: str = "decode") -> dict[str, str]:
    """The PromQL for each snapshot field (pure, so tests can read it)."""
    extra = f",{selector}" if selector else ""
    w = f"{max(1, round(window_s))}s"

    def sel(phase: str) -> str:
        return f'{{model="{model}",phase="{phase}"{extra}}}'

    def rate(metric: str, phase: str) -> str:
        return f"sum(rate({metric}{sel(phase)}[{w}]))"

    def quantile(metric: str) -> str:
        return f"histogram_quantile({percentile}, sum by (le) (rate({metric}_bucket{sel(front)}[{w}])))"

    def mean(metric: str) -> str:
        return f"{rate(metric + '_sum', front)} / {rate(metric + '_count', front)}"

    return {
        "request_rate": rate(names.TTFT + "_count", front),
        "prompt_token_rate": rate(names.PROMPT_TOKENS, prefill),
        "generation_token_rate": rate(names.GENERATION_TOKENS, decode),
        "finished_rate": rate(names.SUCCESS, decode),
        "ttft_p": quantile(names.TTFT),
        "ttft_mean": mean(names.TTFT),
        "itl_p": quantile(names.ITL),
        "itl_mean": mean(names.ITL),
        "prefill_queue_tokens": f"sum({names.PREFILL_QUEUE_TOKENS}{sel(prefill)})",
        "prefill_waiting": f"sum({names.WAITING}{sel(prefill)})",
        "decode_running": f"sum({names.RUNNING}{sel(decode)})",
        "decode_waiting": f"sum({names.WAITING}{sel(decode)})",
        "kv_usage": f"avg({names.KV_USAGE}{sel(decode)})",
        "ready_prefill": f"count({names.RUNNING}{sel(prefill)})",
        "ready_decode": f"count({names.RUNNING}{sel(decode)})",
        "held_requests": f"sum({names.HELD}{sel(front)})",
    }


class PrometheusSource:
    def __init__(self, url: str, model: str, window_s: float, percentile: float, selector: str = "",
                 timeout_s: float = 10.0, client: httpx.AsyncClient | None = None,
                 slo: tuple[float, float] | None = None):
        self.slo = slo
        self.url = url.rstrip("/")
        self.model = model
        self.window_s = window_s
        self.percentile = percentile
        self.selector = selector
        self.timeout_s = timeout_s
        self.client = client

    async def _query(self, client: httpx.AsyncClient, promql: str, at: float) -> float | None:
        r = await client.get(f"{self.url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"})
        if r.status_code >= 400:
            raise PrometheusError(f"{r.status_code} from Prometheus for {promql!r}: {r.text[:200]}")
        body = r.json()
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus: {body.get('error', body)} for {promql!r}")
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if value != value else value  # NaN (0/0 in an idle window) → no data

    async def _buckets(self, client: httpx.AsyncClient, metric: str, front: str, at: float) -> Histogram | None:
        """The window's bucket counts (rate × window) of a router histogram, for attainment."""
        extra = f",{self.selector}" if self.selector else ""
        w = f"{max(1, round(self.window_s))}s"
        promql = (f'sum by (le) (increase({metric}_bucket{{model="{self.model}",phase="{front}"{extra}}}[{w}]))')
        r = await client.get(f"{self.url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"})
        r.raise_for_status()
        h = Histogram()
        for s in r.json()["data"]["result"]:
            v = float(s["value"][1])
            h.buckets[float(s["metric"]["le"])] = 0.0 if v != v else v
        if not h.buckets:
            return None
        h.count = h.buckets.get(float("inf"), max(h.buckets.values()))
        return h

    async def _phases(self, client: httpx.AsyncClient, at: float) -> tuple[str, str, str]:
        """Split mode (router, prefill, decode) or colocated (both for everything)."""
        extra = f",{self.selector}" if self.selector else ""
        promql = f'count by (phase) ({names.RUNNING}{{model="{self.model}"{extra}}})'
        r = await client.get(f"{self.url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"})
        r.raise_for_status()
        phases = {s["metric"].get("phase") for s in r.json()["data"]["result"]}
        has_router = await self._query(
            client, f'count({names.TTFT}_count{{model="{self.model}",phase="router"{extra}}})', at)
        return ("router" if has_router else "both",
                "prefill" if "prefill" in phases else "both",
                "decode" if "decode" in phases else "both")

    async def collect(self, at: float | None = None) -> MetricsSnapshot | None:
        at = time.time() if at is None else at
        client = self.client or httpx.AsyncClient(timeout=self.timeout_s)
        try:
            front, prefill, decode = await self._phases(client, at)
            qs = queries(self.model, self.window_s, self.percentile, self.selector, front, prefill, decode)
            v = {k: await self._query(client, q, at) for k, q in qs.items()}
            hists = [await self._buckets(client, m, front, at) for m in (names.TTFT, names.ITL)] \
                if self.slo else [None, None]
        except httpx.HTTPError as e:
            raise PrometheusError(f"Prometheus at {self.url}: {type(e).__name__}: {e}") from e
        finally:
            if self.client is None:
                await client.aclose()
        if v["ready_prefill"] is None and v["ready_decode"] is None and front != "router":
            return None  # nothing of this model is being scraped (with phases at zero, the router is)
        rate = v["request_rate"]
        return MetricsSnapshot(
            timestamp=at, window_s=self.window_s,
            request_rate=rate,
            prompt_token_rate=v["prompt_token_rate"], generation_token_rate=v["generation_token_rate"],
            ttft_p=v["ttft_p"], ttft_mean=v["ttft_mean"], itl_p=v["itl_p"], itl_mean=v["itl_mean"],
            prefill_queue_tokens=v["prefill_queue_tokens"],
            prefill_waiting=v["prefill_waiting"] if prefill != decode else None,
            decode_running=v["decode_running"], decode_waiting=v["decode_waiting"], kv_usage=v["kv_usage"],
            slo_attainment=attainment(hists[0], hists[1], self.slo),
            ttft_attainment=attainment(hists[0], None, self.slo),
            ready_prefill=int(v["ready_prefill"]) if v["ready_prefill"] else None,
            ready_decode=int(v["ready_decode"]) if v["ready_decode"] else None,
            prompt_tokens_mean=(v["prompt_token_rate"] / rate) if rate and v["prompt_token_rate"] is not None else None,
            generated_tokens_mean=(v["generation_token_rate"] / v["finished_rate"])
            if v["finished_rate"] and v["generation_token_rate"] is not None else None,
            held_requests=v["held_requests"],
        )
