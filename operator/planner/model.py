"""Per-replica performance: a small analytic model, a profile prior, and live self-calibration.

Prefill is compute-bound: a replica turns prompt tokens into KV cache at a roughly constant
rate, plus a fixed per-request overhead. Decode is memory-bandwidth-bound: one step reads the
weights once (a fixed cost), does a little compute per sequence, and reads the KV cache of
every running sequence (a cost per context token), so

    step_time(batch, context) = base + per_seq·batch + per_token·batch·context.

Offline profiling (hours, in Dynamo's planner) only pins these constants down for one setup.
Here a profile is an optional prior; the live metrics correct it every window by inverting
the same models the planner sizes with (mean TTFT → prefill tokens/s; mean ITL → a scale on
the step-time curve), smoothed in log space so one odd window cannot swing it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from phasesplit.operator.planner.queueing import mean_ttft, ttft_quantile
from phasesplit.operator.planner.snapshot import MetricsSnapshot


@dataclass(frozen=True)
class PrefillProfile:
    tokens_per_s: float = 9000.0  # one replica's prefill throughput
    overhead_s: float = 0.01  # per-request fixed cost (scheduling, first decode step, KV hand-off)


@dataclass(frozen=True)
class DecodeProfile:
    base_s: float = 0.012  # step time of an empty batch: reading the weights once
    per_seq_s: float = 0.00012  # compute per running sequence per step
    per_token_s: float = 85e-9  # KV read per context token per step
    max_batch: int = 256  # the runtime's --max-num-seqs
    # KV geometry (2 × layers × kv_heads × head_dim × dtype bytes per token) and the bytes of KV
    # cache one replica holds: capacity in tokens follows.
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    kv_cache_bytes: float = 20e9

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_capacity_tokens(self) -> float:
        return self.kv_cache_bytes / self.kv_bytes_per_token

    def step_time(self, batch: float, context: float) -> float:
        return self.base_s + batch * (self.per_seq_s + self.per_token_s * context)

    def max_batch_for_itl(self, itl_s: float, context: float) -> float:
        """Largest batch whose step time stays within itl_s (0 when even one sequence misses)."""
        per = self.per_seq_s + self.per_token_s * context
        room = itl_s - self.base_s
        if room <= 0:
            return 0.0
        return min(float(self.max_batch), room / per)


@dataclass
class PerfModel:
    """The current belief about one replica's performance, corrected from live metrics."""

    prefill: PrefillProfile
    decode: DecodeProfile
    decode_scale: float = 1.0  # observed ITL / modelled step time, smoothed
    prefill_samples: int = 0
    decode_samples: int = 0
    token_scv: float | None = None  # prompt-length squared CV fitted from TTFT tails (None: the prior)
    scv_samples: int = 0
    smoothing: float = 0.3  # weight of a new window's estimate (in log space)
    min_requests: int = 20  # windows with fewer requests say too little to calibrate on
    bound_ratio: float = 0.8  # a busy pool serving below this share of the estimate lowers it

    def step_time(self, batch: float, context: float) -> float:
        return self.decode_scale * self.decode.step_time(batch, context)

    def max_batch_for_itl(self, itl_s: float, context: float) -> float:
        return self.decode.max_batch_for_itl(itl_s / self.decode_scale, context)

    def _blend(self, old: float, new: float, lo: float, hi: float) -> float:
        new = min(max(new, lo), hi)
        return math.exp((1 - self.smoothing) * math.log(old) + self.smoothing * math.log(new))

    def scv(self, prior: float) -> float:
        return self.token_scv if self.token_scv is not None else prior

    def calibrate(self, snap: MetricsSnapshot, token_scv: float, kv_high: float,
                  percentile: float | None = None) -> list[str]:
        """Update the estimates from one window; returns notes on what changed (for the reason)."""
        notes: list[str] = []
        enough = (snap.request_rate or 0.0) * snap.window_s >= self.min_requests
        isl = snap.mean_prompt_tokens
        # Prefill: solve mean_ttft(μ) = observed mean TTFT for μ (monotone, so bisection). Skip
        # windows where decode was the bottleneck: requests then wait for KV blocks before
        # prefill starts, and blaming prefill for that would scale the wrong phase.
        decode_bound = (snap.decode_waiting or 0) > 0 or (snap.kv_usage or 0) >= kv_high
        token_scv = self.scv(token_scv)
        if (enough and isl and snap.ttft_mean and snap.ready_prefill and not decode_bound):
            mu = self._invert_prefill(snap.ready_prefill, snap.request_rate, isl, snap.ttft_mean, token_scv)
            if mu is not None:
                # Observed throughput is a hard lower bound on capacity.
                mu = max(mu, (snap.prompt_token_rate or 0.0) / snap.ready_prefill)
                old = self.prefill.tokens_per_s
                new = self._blend(old, mu, old / 4, old * 4)
                self.prefill = replace(self.prefill, tokens_per_s=new)
                self.prefill_samples += 1
                if abs(new / old - 1) > 0.05:
                    notes.append(f"prefill capacity {old:.0f}→{new:.0f} tok/s")
            # The TTFT tail against its mean says how variable prompts are (the runtime exports no
            # prompt-length histogram): fit the squared CV that makes the model's quantile match.
            big = (snap.request_rate or 0.0) * snap.window_s >= 5 * self.min_requests
            if percentile is not None and snap.ttft_p and big:
                fitted = self._fit_scv(snap.ready_prefill, snap.request_rate, isl, snap.ttft_p, percentile)
                if fitted is not None:
                    old_scv = token_scv
                    self.token_scv = self._blend(old_scv, fitted, old_scv / 4, old_scv * 4)
                    self.scv_samples += 1
                    if abs(self.token_scv / old_scv - 1) > 0.1:
                        notes.append(f"prompt SCV {old_scv:.2f}→{self.token_scv:.2f}")
        # Decode: ITL observed against the modelled step time at the observed batch and context.
        osl = snap.mean_generated_tokens
        if (enough and isl is not None and osl is not None and snap.itl_mean and snap.decode_running
                and snap.ready_decode):
            batch = snap.decode_running / snap.ready_decode
            modelled = self.decode.step_time(batch, isl + osl / 2)
            old = self.decode_scale
            self.decode_scale = self._blend(old, snap.itl_mean / modelled, 0.2, 5.0)
            self.decode_samples += 1
            if abs(self.decode_scale / old - 1) > 0.05:
                notes.append(f"decode step scale {old:.2f}→{self.decode_scale:.2f}")
        return notes

    def bound_prefill(self, snap: MetricsSnapshot) -> list[str]:
        """Lower the prefill estimate to what a pool busy all through the window served.

        Calibration inverts latencies of healthy windows only, so a prior far above the truth is
        never corrected by the overload it causes: its model sees a queue that never shrinks as
        one that drains by itself. A pool queued through a whole window served at its capacity,
        though, so the prompts it served per replica are a measurement of that capacity (a bound
        from above), applied at once rather than blended. Only a clear shortfall counts (served
        below `bound_ratio` of the estimate): near the estimate, the window's idle moments and
        the per-request overhead are the difference. The caller decides the pool was busy;
        healthy windows raise the estimate again (calibrate's lower bound and inversion).
        """
        isl, ready = snap.mean_prompt_tokens, snap.ready_prefill
        if not isl or not ready or not snap.prompt_token_rate:
            return []
        served_requests = snap.prompt_token_rate * snap.window_s / isl
        # A counter over a busy window measures throughput to about one request's worth: fewer
        # requests than calibration needs (which inverts a noisy latency model) suffice.
        if served_requests < self.min_requests / 2:
            return []
        per_request_s = ready * isl / snap.prompt_token_rate - self.prefill.overhead_s
        if per_request_s <= 0:
            return []
        measured = isl / per_request_s  # the token rate that, with the overhead, gives what was served
        old = self.prefill.tokens_per_s
        if measured >= self.bound_ratio * old:
            return []
        self.prefill = replace(self.prefill, tokens_per_s=measured)
        return [f"prefill capacity {old:.0f}→{measured:.0f} tok/s, what a pool queued all window served"]

    def _fit_scv(self, servers: int, rate: float, isl: float, observed: float, percentile: float) -> float | None:
        prof = self.prefill
        f = lambda v: ttft_quantile(servers, rate, isl, prof.tokens_per_s, prof.overhead_s, v, percentile)  # noqa: E731
        lo, hi = 0.05, 5.0
        if f(lo) >= observed or f(hi) <= observed:
            return None  # outside what prompt variability can explain: say nothing
        return _log_bisect(f, lo, hi, observed, 20, increasing=True)

    def _invert_prefill(self, servers: int, rate: float, isl: float, observed: float,
                        token_scv: float) -> float | None:
        lo, hi = self.prefill.tokens_per_s / 50, self.prefill.tokens_per_s * 50
        f = lambda mu: mean_ttft(servers, rate, isl, mu, self.prefill.overhead_s, token_scv)  # noqa: E731
        if f(hi) > observed:
            # Even a very fast prefill would not explain a TTFT this low: the overhead estimate
            # is too high; the token rate says nothing useful this window.
            return None
        if f(lo) < observed:
            return lo
        return _log_bisect(f, lo, hi, observed, 60, increasing=False)


def _log_bisect(f, lo: float, hi: float, target: float, iters: int, increasing: bool) -> float:
    """The x in [lo, hi] where the monotonic f crosses target, bisected in log space (the
    unknowns here span orders of magnitude)."""
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if (f(mid) > target) == increasing:
            hi = mid
        else:
            lo = mid
    return math.sqrt(lo * hi)
