"""Pure statistics over per-request results: latencies, throughput, goodput, phase shares.

Definitions follow vLLM's benchmark so numbers compare across tools:
- TTFT: request sent -> first content chunk received.
- ITL: gap between consecutive content chunks (one value per gap, pooled over requests).
- TPOT: per request, (E2EL - TTFT) / (output tokens - 1).
- E2EL: request sent -> stream finished.
- goodput: completed requests that meet every SLO, per second of benchmark duration.
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from phasesplit.runtime import units

SLO_KEYS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds; start_s is relative to the run start."""

    index: int
    kind: str
    prompt_len: int  # intended prompt tokens
    output_len: int  # requested max_tokens
    start_s: float = 0.0
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    e2el_s: float | None = None
    # Arrival of every content chunk, relative to start_s (the first one is the TTFT).
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0  # usage.completion_tokens when the server reports it, else chunks
    server_prompt_tokens: int | None = None  # usage.prompt_tokens when reported
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    phase_timing: dict[str, float] | None = None  # seconds per phase, when the server reports it

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> RequestResult:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


# ---------------------------------------------------------------- basic statistics


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default method); NaN for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    if not values:
        return math.nan
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


PERCENTILES = (50, 90, 99)


def describe(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 and count of a sample."""
    out = {"mean": mean(values)}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p)
    out["count"] = len(values)
    return out


# ---------------------------------------------------------------- per-request derived values


def itls(r: RequestResult) -> list[float]:
    t = r.chunk_times_s
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def tpot(r: RequestResult) -> float | None:
    if not r.ok or r.e2el_s is None or r.ttft_s is None or r.output_tokens < 2:
        return None
    return (r.e2el_s - r.ttft_s) / (r.output_tokens - 1)


def mean_itl(r: RequestResult) -> float | None:
    gaps = itls(r)
    return mean(gaps) if gaps else None


# ---------------------------------------------------------------- SLOs


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=500ms,itl=50ms' -> {'ttft': 0.5, 'itl': 0.05}. A bare number is milliseconds."""
    return units.parse_slo(text, SLO_KEYS)


def slo_value(r: RequestResult, key: str) -> float | None:
    """The request's value for an SLO key; None where it is undefined (e.g. TPOT of one token)."""
    if key == "ttft":
        return r.ttft_s
    if key == "tpot":
        return tpot(r)
    if key == "itl":
        # The request's mean gap: what a reader of the stream perceives as speed. Single stalls
        # show up in the pooled ITL p99 rather than failing the request outright.
        return mean_itl(r)
    if key == "e2el":
        return r.e2el_s
    raise KeyError(key)


def meets(r: RequestResult, slo: Mapping[str, float], key: str) -> bool:
    if not r.ok:
        return False
    v = slo_value(r, key)
    return v is None or v <= slo[key]


def meets_all(r: RequestResult, slo: Mapping[str, float]) -> bool:
    return r.ok and all(meets(r, slo, k) for k in slo)


# ---------------------------------------------------------------- phase breakdown


def phase_breakdown(results: Sequence[RequestResult]) -> dict[str, dict[str, float]] | None:
    """Mean seconds and mean share of E2EL per server-reported phase; None if none reported."""
    rows = [r for r in results if r.ok and r.phase_timing and r.e2el_s]
    if not rows:
        return None
    names: list[str] = []
    for r in rows:
        names += [k for k in r.phase_timing if k not in names]
    out = {}
    for name in names:
        have = [r for r in rows if name in r.phase_timing]
        out[name] = {
            "mean_s": mean([r.phase_timing[name] for r in have]),
            "mean_share": mean([r.phase_timing[name] / r.e2el_s for r in have]),
            "count": len(have),
        }
    return out


# ---------------------------------------------------------------- summary


def summarize(
    results: Sequence[RequestResult], duration_s: float, slo: Mapping[str, float] | None = None
) -> dict:
    """Everything the report prints, as plain numbers (seconds, per second, fractions)."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.server_prompt_tokens if r.server_prompt_tokens is not None else r.prompt_len for r in ok)
    s: dict = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration_s,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": prompt_tokens,
        "ttft_s": describe([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": describe([v for r in ok if (v := tpot(r)) is not None]),
        "itl_s": describe([g for r in ok for g in itls(r)]),
        "e2el_s": describe([r.e2el_s for r in ok if r.e2el_s is not None]),
        # Servers that ignore ignore_eos stop early; lengths the server counted differently
        # from what was built mean the tokenizer does not match the server's.
        "short_outputs": sum(1 for r in ok if r.output_tokens < r.output_len),
        "prompt_len_mismatches": sum(
            1 for r in ok if r.server_prompt_tokens is not None and r.server_prompt_tokens != r.prompt_len
        ),
        # Prompt tokens the server took from its prefix cache, where it says so.
        "cached_prompt_tokens": sum(r.cached_tokens or 0 for r in ok),
    }
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"{r.status or 'no response'}: {r.error or 'unknown error'}"[:200]
            errors[key] = errors.get(key, 0) + 1
    s["errors"] = errors
    if slo:
        good = [r for r in results if meets_all(r, slo)]
        s["slo"] = dict(slo)
        s["goodput"] = len(good) / duration_s
        s["slo_attainment"] = len(good) / len(results) if results else math.nan
        s["slo_attainment_by_key"] = {
            k: (sum(1 for r in results if meets(r, slo, k)) / len(results) if results else math.nan) for k in slo
        }
    phases = phase_breakdown(results)
    if phases is not None:
        s["phases"] = phases
    return s


def summarize_by_kind(
    results: Sequence[RequestResult], duration_s: float, slo: Mapping[str, float] | None = None
) -> dict[str, dict]:
    """The summary per request class (chat/doc in the mixed workload); empty for a single class."""
    kinds = sorted({r.kind for r in results})
    if len(kinds) < 2:
        return {}
    return {k: summarize([r for r in results if r.kind == k], duration_s, slo) for k in kinds}
