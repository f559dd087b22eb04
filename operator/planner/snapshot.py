"""The planner's input: what the service did over the last metrics window."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricsSnapshot:
    """Aggregates over one window (rates per second, latencies in seconds).

    Latency percentiles come from histogram *deltas* over the window (the bucket counts at the
    end minus those at the start), never from lifetime totals: a lifetime average hides a
    fresh SLO miss behind hours of good history. Fields a source could not fill are None.
    """

    timestamp: float  # end of the window, seconds (any epoch; compared with `now`)
    window_s: float
    request_rate: float | None = None  # requests arriving at the router per second
    prompt_token_rate: float | None = None  # prompt tokens prefilled per second (counted as prefills finish)
    generation_token_rate: float | None = None  # generated tokens per second
    ttft_p: float | None = None  # router-side TTFT at the SLO percentile
    ttft_mean: float | None = None
    itl_p: float | None = None  # router-side inter-token latency at the SLO percentile
    itl_mean: float | None = None
    prefill_queue_tokens: float | None = None  # prompt tokens waiting for prefill, all replicas
    prefill_waiting: float | None = None  # requests waiting for prefill, all replicas
    decode_running: float | None = None  # requests in decode batches, all replicas
    decode_waiting: float | None = None  # requests waiting for KV blocks on decode
    kv_usage: float | None = None  # mean fraction of decode KV cache in use, 0-1
    slo_attainment: float | None = None  # fraction of the window's requests meeting both SLOs
    ttft_attainment: float | None = None  # fraction of the window's first tokens within the TTFT target
    ready_prefill: int | None = None  # replicas that served the window (for calibration)
    ready_decode: int | None = None
    # Per-request token means from the request-size histograms (sum/count deltas). Preferred
    # over token rate ÷ request rate: while a phase is saturated its token counters advance at
    # its capacity, not at demand, and the ratio understates the work per request just when
    # the sizing matters most.
    prompt_tokens_mean: float | None = None
    # Requests the router holds because no worker could take them (a phase at zero): they wake it.
    held_requests: float | None = None
    generated_tokens_mean: float | None = None

    @property
    def mean_prompt_tokens(self) -> float | None:
        return _per_request(self.prompt_tokens_mean, self.prompt_token_rate, self.request_rate)

    @property
    def mean_generated_tokens(self) -> float | None:
        return _per_request(self.generated_tokens_mean, self.generation_token_rate, self.request_rate)


def _per_request(mean: float | None, token_rate: float | None, request_rate: float | None) -> float | None:
    """The mean tokens per request: measured where a source gives it, else token rate / request rate."""
    if mean is not None:
        return mean
    if not request_rate or token_rate is None:
        return None
    return token_rate / request_rate
