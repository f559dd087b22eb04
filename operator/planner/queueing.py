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
    """A conservative quantile of the service time from its mean and squared CV (normal tail)."""
    z = NormalDist().inv_cdf(quantile)
    return mean_service * (1.0 + z * math.sqrt(max(service_scv, 0.0)))


def ttft_quantile(servers: int, arrival_rate: float, mean_tokens: float, tokens_per_s: float,
                  overhead_s: float, token_scv: float, quantile: float) -> float:
    """Prefill TTFT at `quantile`: queueing wait plus the service of a long-ish prompt.

    Adding the two quantiles overestimates the quantile of their sum; the planner wants that
    side of the error.
    """
    mean_service = overhead_s + mean_tokens / tokens_per_s
    # Overhead is fixed per request; only the token part varies, so the service SCV shrinks.
    scv = token_scv * (mean_tokens / tokens_per_s) ** 2 / mean_service**2 if mean_service > 0 else 0.0
    return (wait_quantile(servers, arrival_rate, mean_service, scv, quantile)
            + service_quantile(mean_service, scv, quantile))


def replicas_for_ttft(arrival_rate: float, mean_tokens: float, tokens_per_s: float, overhead_s: float,
                      token_scv: float, quantile: float, target_s: float, max_utilisation: float,
                      limit: int) -> tuple[int, float, bool]:
    """Fewest replicas (≤ limit) whose TTFT quantile meets target_s and utilisation ≤ max_utilisation.

    Returns (replicas, predicted TTFT quantile, reachable). When the service time of a long
    prompt alone eats the target, no replica count meets it; scaling out still shortens the
    queue, so the count is sized for a queueing wait of a fifth of the target and `reachable`
    is False (the caller says so instead of running to the maximum).
    """
    mean_service = overhead_s + mean_tokens / tokens_per_s
    scv = token_scv * (mean_tokens / tokens_per_s) ** 2 / mean_service**2 if mean_service > 0 else 0.0
    fixed = service_quantile(mean_service, scv, quantile)
    wait_budget = target_s - fixed
    reachable = wait_budget >= 0.2 * target_s
    if not reachable:
        wait_budget = 0.2 * target_s
    load = arrival_rate * mean_service
    c = max(1, math.ceil(load / max_utilisation))
    while c < limit and wait_quantile(c, arrival_rate, mean_service, scv, quantile) > wait_budget:
        c += 1
    c = min(c, limit)
    predicted = wait_quantile(c, arrival_rate, mean_service, scv, quantile) + fixed
    return c, predicted, reachable and predicted <= target_s


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
