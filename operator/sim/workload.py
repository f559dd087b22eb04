"""Workloads for the simulator: generated shapes and the Azure LLM inference trace CSV format."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from phasesplit.runtime.bench import workload as bench_workload

GENERATED = ("steady", "bursty", "diurnal", "shift", "idle")


@dataclass(frozen=True)
class Request:
    arrival: float
    isl: int  # prompt tokens
    osl: int  # generated tokens


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(max(rng.lognormvariate(math.log(median), sigma), lo), hi))


def _poisson(rng: random.Random, rate_at, peak: float, duration: float):
    """Arrival times of a Poisson process with time-varying rate (thinning)."""
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return
        if rng.random() * peak <= rate_at(t):
            yield t


def generate(kind: str, duration: float, rate: float, seed: int) -> list[Request]:
    """steady: Poisson at `rate`; bursty: 2.5× bursts of 3-6 min at random; diurnal: one
    compressed day (0.3×-1.7× of `rate`); shift: short prompts then long prompts; idle: sessions
    of 2-5 min separated by 4-12 min of silence."""
    rng = random.Random(seed)
    if kind == "steady":
        rate_at, peak = (lambda t: rate), rate
    elif kind == "bursty":
        # Flash crowds: 2.5× the base rate for 3-6 minutes, reached over a 30 s ramp, every
        # 8-15 minutes.
        bursts, t = [], rng.uniform(120, 400)
        while t < duration:
            length = rng.uniform(180, 360)
            bursts.append((t, t + length))
            t += length + rng.uniform(300, 540)
        base = rate * 0.65

        def rate_at(t: float) -> float:
            for a, b in bursts:
                if a <= t < b:
                    return base * (1 + 1.5 * min(1.0, (t - a) / 30, (b - t) / 30))
            return base
        peak = base * 2.5
    elif kind == "diurnal":
        def rate_at(t: float) -> float:
            return rate * (1 - 0.7 * math.cos(2 * math.pi * t / duration))
        peak = rate * 1.7
    elif kind == "shift":
        rate_at, peak = (lambda t: rate), rate
    elif kind == "idle":
        # Sessions of 2-5 minutes at 0.5-1× the rate separated by 4-12 minutes of silence (what
        # scale to zero is for: an internal tool, a batch job's bursts, a night).
        sessions, t = [], rng.uniform(60, 180)
        while t < duration:
            length = rng.uniform(120, 300)
            sessions.append((t, t + length, rate * rng.uniform(0.5, 1.0)))
            t += length + rng.uniform(240, 720)

        def rate_at(t: float) -> float:
            return next((r for a, b, r in sessions if a <= t < b), 0.0)
        peak = rate
    else:
        raise ValueError(f"unknown workload {kind!r}: use {', '.join(GENERATED)} or a trace CSV file")
    out = []
    for t in _poisson(rng, rate_at, peak, duration):
        if kind == "shift" and t >= duration / 2:
            isl, osl = _lognormal(rng, 2000, 0.3, 64, 3000), _lognormal(rng, 60, 0.6, 2, 400)
        elif kind == "shift":
            isl, osl = _lognormal(rng, 300, 0.6, 16, 2000), _lognormal(rng, 300, 0.6, 4, 1000)
        else:
            isl, osl = _lognormal(rng, 800, 0.8, 16, 3000), _lognormal(rng, 150, 0.8, 2, 1000)
        out.append(Request(t, isl, osl))
    return out


def read_trace(path: str | Path, time_scale: float = 1.0, token_scale: float = 1.0,
               duration: float | None = None) -> list[Request]:
    """An Azure LLM inference trace CSV (read by the bench tool's reader); times become seconds
    from the first row.

    time_scale > 1 compresses time (more requests per second); token_scale multiplies both
    token counts. duration (after scaling) cuts the trace.
    """
    out = []
    for row in bench_workload.read_trace(path):
        at = row.arrival_s / time_scale
        if duration is not None and at >= duration:
            break
        out.append(Request(at, max(1, round(row.context_tokens * token_scale)),
                           max(1, round(row.generated_tokens * token_scale))))
    return out


def replay(requests: list[Request], period: float, times: int) -> list[Request]:
    """The workload `times` times back to back, each pass `period` seconds after the last."""
    return [Request(r.arrival + k * period, r.isl, r.osl) for k in range(times) for r in requests]
