"""Queueing estimates for the prefill pool.

Prefill TTFT is service time plus queueing delay, and the queueing part is what a utilisation
threshold (or a throughput-only model such as "replicas = token rate / tokens per second per
replica") cannot see: at 85 % utilisation the mean wait of an M/M/1 queue is already 5.7
service times, and bursty arrivals make it worse. The pool is modelled as M/G/c (Poisson
arrivals, general service times, c replicas fed from the router's least-queued choice, which
behaves close to one shared queue). Waiting times use the Erlang C formula with the
Allen-Cunneen correction (1 + cs²)/2 for the variability of prompt lengths.
"""

from __future__ import annotations

import math
from statistics import NormalDist


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in an M/M/c queue (offered_load = λ·E[S], in Erlangs)."""
    if offered_load <= 0:
        return 0.0
    if offered_load >= servers:
        return 1.0
    # Erlang B by its stable recurrence, then C from B (no factorials, no overflow).
    b = 1.0
    for k in range(1, servers + 1):
        b = offered_load * b / (k + offered_load * b)
    rho = offered_load / servers
    return b / (1.0 - rho * (1.0 - b))


def wait_quantile(servers: int, arrival_rate: float, mean_service: float, service_scv: float,
                  quantile: float) -> float:
    """Queueing delay (before service starts) not exceeded by `quantile` of requests.

    M/M/c: P(W > t) = C·exp(-(c/E[S] - λ)·t); the Allen-Cunneen factor scales it for general
    service times. Returns inf when the pool is saturated (ρ ≥ 1).
    """
    if arrival_rate <= 0 or mean_service <= 0:
        return 0.0
    load = arrival_rate * mean_service
    if load >= servers:
        return math.inf
    p_wait = erlang_c(servers, load)
    tail = 1.0 - quantile
    if p_wait <= tail:
        return 0.0
    decay = servers / mean_service - arrival_rate
    return math.log(p_wait / tail) / decay * (1.0 + service_scv) / 2.0


def service_quantile(mean_service: float, service_scv: float, quantile: float) -> float:
    """Quantile of a lognormal service time with this mean and squared CV (prompt lengths in
    production traces are close to lognormal)."""
    if mean_service <= 0:
        return 0.0
    if service_scv <= 0:
        return mean_service
    sigma = math.sqrt(math.log1p(service_scv))
    mu = math.log(mean_service) - sigma**2 / 2
    return math.exp(mu + sigma * NormalDist().inv_cdf(quantile))


def _lognormal_tail(mean: float, scv: float):
    """x ↦ P(S > x) for a lognormal S with this mean and squared CV."""
    if scv <= 0:
        return lambda x: 1.0 if x < mean else 0.0
    sigma = math.sqrt(math.log1p(scv))
    mu = math.log(mean) - sigma**2 / 2
    root2 = sigma * math.sqrt(2)
    return lambda x: 1.0 if x <= 0 else 0.5 * math.erfc((math.log(x) - mu) / root2)


def ttft_quantile(servers: int, arrival_rate: float, mean_tokens: float, tokens_per_s: float,
                  overhead_s: float, token_scv: float, quantile: float) -> float:
    """Prefill TTFT at `quantile`: the quantile of wait + service, not the sum of two quantiles
    (which overstates the tail, since a long wait and a long prompt rarely coincide).

    Wait: 0 with probability 1 - C, else exponential with the Allen-Cunneen mean. Service:
    the fixed overhead plus a lognormal token time. The tail of the sum is integrated
    numerically and inverted by bisection.
    """
    token_time = mean_tokens / tokens_per_s
    mean_service = overhead_s + token_time
    load = arrival_rate * mean_service
    if load >= servers:
        return math.inf
    scv = token_scv * token_time**2 / mean_service**2 if mean_service > 0 else 0.0
    p_wait = erlang_c(servers, load) if arrival_rate > 0 else 0.0
    theta = (servers / mean_service - arrival_rate) * 2.0 / (1.0 + scv)
    tail_s = _lognormal_tail(token_time, token_scv)

    def tail(t: float) -> float:
        x = t - overhead_s
        direct = tail_s(x)
        if p_wait <= 0:
            return direct
        steps = 64
        h = max(x, 0.0) / steps
        acc = 0.0
        for k in range(steps + 1):  # ∫0^x P(S > x-w) θe^{-θw} dw, trapezoid
            w = k * h
            f = tail_s(x - w) * theta * math.exp(-theta * w)
            acc += f if 0 < k < steps else f / 2
        conv = acc * h + math.exp(-theta * max(x, 0.0))
        return (1 - p_wait) * direct + p_wait * conv

    target = 1.0 - quantile
    lo, hi = overhead_s, overhead_s + service_quantile(token_time, token_scv, quantile) + \
        (math.log(max(p_wait, target) / target) / theta if p_wait > target else 0.0) + 1e-6
    while tail(hi) > target:
        hi *= 2
    for _ in range(30):
        mid = (lo + hi) / 2
        if tail(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


def replicas_for_ttft(arrival_rate: float, mean_tokens: float, tokens_per_s: float, overhead_s: float,
                      token_scv: float, quantile: float, target_s: float, max_utilisation: float,
                      limit: int) -> tuple[int, float, bool]:
    """Fewest replicas (≤ limit) whose TTFT quantile meets target_s and utilisation ≤ max_utilisation.

    Returns (replicas, predicted TTFT quantile, reachable). When the service time of a long
    prompt alone nears the target, no replica count meets it; scaling out still shortens the
    queue, so the count is sized for a queueing wait of a fifth of the target and `reachable`
    is False (the caller says so instead of running to the maximum).
    """
    mean_service = overhead_s + mean_tokens / tokens_per_s
    load = arrival_rate * mean_service
    c = max(1, math.ceil(load / max_utilisation))
    floor = overhead_s + service_quantile(mean_tokens / tokens_per_s, token_scv, quantile)
    if target_s - floor < 0.2 * target_s:
        scv = token_scv * (mean_tokens / tokens_per_s) ** 2 / mean_service**2 if mean_service > 0 else 0.0
        while c < limit and wait_quantile(c, arrival_rate, mean_service, scv, quantile) > 0.2 * target_s:
            c += 1
        c = min(c, limit)
        return c, ttft_quantile(c, arrival_rate, mean_tokens, tokens_per_s, overhead_s, token_scv, quantile), False
    c = min(c, limit)
    predicted = ttft_quantile(c, arrival_rate, mean_tokens, tokens_per_s, overhead_s, token_scv, quantile)
    while c < limit and predicted > target_s:
        c += 1
        predicted = ttft_quantile(c, arrival_rate, mean_tokens, tokens_per_s, overhead_s, token_scv, quantile)
    return c, predicted, predicted <= target_s


def mean_ttft(servers: int, arrival_rate: float, mean_tokens: float, tokens_per_s: float,
              overhead_s: float, token_scv: float) -> float:
    """Mean prefill TTFT in M/G/c (Allen-Cunneen): mean wait plus mean service."""
    mean_service = overhead_s + mean_tokens / tokens_per_s
    load = arrival_rate * mean_service
    if load >= servers:
        return math.inf
    scv = token_scv * (mean_tokens / tokens_per_s) ** 2 / mean_service**2 if mean_service > 0 else 0.0
    wait = erlang_c(servers, load) * mean_service / (servers - load) * (1.0 + scv) / 2.0
    return wait + mean_service
