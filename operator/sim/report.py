"""Running policies over a workload, the best-static search, and the summary/plot."""

from __future__ import annotations

import math
from dataclasses import dataclass

from phasesplit.operator.sim.engine import Policy, Simulation, quantile
from phasesplit.operator.sim.policies import StaticPolicy
from phasesplit.operator.sim.profile import SimProfile
from phasesplit.operator.sim.workload import Request


@dataclass(frozen=True)
class Setup:
    requests: list[Request]
    profile: SimProfile
    ttft: float
    itl: float
    percentile: float
    duration: float


def simulate(setup: Setup, policy: Policy, initial: dict[str, int], interval: float) -> Simulation:
    return Simulation(setup.requests, setup.profile, policy, initial, interval, setup.ttft, setup.itl,
                      setup.percentile, setup.duration).run()


def initial_counts(setup: Setup, policy_planner) -> dict[str, int]:
    """Replicas a running service would already have when the simulation starts: the planner's
    model sizing for the first minute of traffic (no behavior rules, no history). Autoscaled
    policies start here rather than at 1+1, so a cold-start backlog does not dominate results.
    """
    from phasesplit.operator.planner.snapshot import MetricsSnapshot

    head = [r for r in setup.requests if r.arrival < 60.0]
    if not head:
        return {"prefill": 1, "decode": 1}
    snap = MetricsSnapshot(timestamp=0.0, window_s=60.0, request_rate=len(head) / 60.0,
                           prompt_token_rate=sum(r.isl for r in head) / 60.0,
                           generation_token_rate=sum(r.osl for r in head) / 60.0)
    d = policy_planner.plan(snap, {"prefill": 1, "decode": 1}, 0.0)
    return {"prefill": d.prefill.recommended, "decode": d.decode.recommended}


def summarize(sim: Simulation, name: str, workload: str, warmup: float = 0.0) -> dict:
    """Attainment over the requests arriving after `warmup`, replica-seconds over the same span
    (a trace starts mid-traffic; no policy should be judged on the first minutes' sizing)."""
    ttft_lim, itl_lim = sim.slo
    counted = [o for o in sim.out if o.arrival >= warmup]
    done = [o for o in counted if not math.isnan(o.done)]
    n = len(counted)
    ttft_ok = sum(1 for o in done if o.ttft <= ttft_lim)
    itl_ok = sum(1 for o in done if o.itl <= itl_lim)
    both = sum(1 for o in done if o.ttft <= ttft_lim and o.itl <= itl_lim)
    rs = sim.replica_seconds(warmup)
    span = sim.duration - warmup
    return {
        "policy": name,
        "workload": workload,
        "requests": n,
        "attainment": both / n if n else 1.0,
        "ttft_attainment": ttft_ok / n if n else 1.0,
        "itl_attainment": itl_ok / n if n else 1.0,
        "goodput_rps": both / span if span > 0 else 0.0,
        "replica_seconds": {k: round(v, 1) for k, v in rs.items()},
        "mean_replicas": {k: round(v / span, 2) for k, v in rs.items()} if span > 0 else {},
        "ttft_p95_s": quantile([o.ttft for o in done], 0.95),
        "itl_p95_s": quantile([o.itl for o in done if o.osl > 1], 0.95),
        "scale_events": sum(1 for _ in _changes(sim)),
        **_held(counted),
    }


def _held(counted: list) -> dict:
    """Requests the router held while a phase was at zero: how many, whether each got its first
    token, and their TTFT (start-up + up to one interval is the price of zero)."""
    held = [o for o in counted if o.held]
    if not held:
        return {}
    answered = [o for o in held if not math.isnan(o.first_token)]
    return {"held": {"requests": len(held), "answered": len(answered),
                     "ttft_p50_s": quantile([o.ttft for o in answered], 0.5),
                     "ttft_p95_s": quantile([o.ttft for o in answered], 0.95),
                     "ttft_max_s": max((o.ttft for o in answered), default=None)}}


def _changes(sim: Simulation):
    prev = None
    for s in sim.samples:
        cur = (s.prefill, s.decode)
        if prev is not None and cur != prev:
            yield s.t
        prev = cur


def best_static(setup: Setup, reference: float, max_replicas: int, interval: float,
                warmup: float = 0.0, cache: dict | None = None) -> tuple[dict, Simulation, int]:
    """Cheapest fixed (prefill, decode) whose attainment reaches `reference`.

    Attainment rises with either count (more of a phase never hurts here), so each phase's
    minimum is found by bisection with the other phase generous, then the decode count is
    re-bisected around the prefill minimum and its neighbour (the phases interact through KV
    reservations held during prefill queueing). Returns the summary, the run and runs made.
    """
    cache = {} if cache is None else cache

    def run(p: int, d: int) -> tuple[float, Simulation]:
        if (p, d) not in cache:
            sim = simulate(setup, StaticPolicy(p, d), {"prefill": p, "decode": d}, interval)
            cache[(p, d)] = (summarize(sim, "static", "", warmup)["attainment"], sim)
        return cache[(p, d)]

    def lowest(ok, lo: int, hi: int) -> int | None:
        if not ok(hi):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    top = max_replicas
    p_min = lowest(lambda p: run(p, top)[0] >= reference, 1, top)
    if p_min is None:
        # Nothing static reaches the reference: report the most provisioned point.
        return _static_summary(run(top, top)[1], top, top, warmup), run(top, top)[1], len(cache)
    best = None
    for p in (p_min, min(p_min + 1, top)):
        d = lowest(lambda d, p=p: run(p, d)[0] >= reference, 1, top)
        if d is not None and (best is None or p + d < best[0] + best[1]):
            best = (p, d)
    p, d = best
    sim = run(p, d)[1]
    return _static_summary(sim, p, d, warmup), sim, len(cache)


def _static_summary(sim: Simulation, p: int, d: int, warmup: float) -> dict:
    out = summarize(sim, "static", "", warmup)
    out["static_replicas"] = {"prefill": p, "decode": d}
    return out


def table(rows: list[dict]) -> str:
    head = f"{'policy':<12} {'attain':>7} {'TTFT ok':>8} {'ITL ok':>7} {'rep-s prefill':>14} {'rep-s decode':>13} " \
           f"{'rep-s total':>12} {'mean P+D':>10} {'TTFT p95':>9} {'ITL p95':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rs, mr = r["replica_seconds"], r["mean_replicas"]
        label = r["policy"] + (f" {r['static_replicas']['prefill']}+{r['static_replicas']['decode']}"
                               if "static_replicas" in r else "")
        lines.append(
            f"{label:<12} {r['attainment'] * 100:6.1f}% {r['ttft_attainment'] * 100:7.1f}% "
            f"{r['itl_attainment'] * 100:6.1f}% {rs['prefill']:14.0f} {rs['decode']:13.0f} {rs['total']:12.0f} "
            f"{mr.get('prefill', 0):4.1f}+{mr.get('decode', 0):<4.1f} "
            f"{_ms(r['ttft_p95_s']):>9} {_ms(r['itl_p95_s']):>8}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


def plot(path: str, sims: dict[str, Simulation], title: str, ttft: float, itl: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    first = next(iter(sims.values()))
    axes[0].plot([s.t / 60 for s in first.samples], [s.arrivals_per_s for s in first.samples], color="gray")
    axes[0].set_ylabel("arrivals/s")
    axes[0].set_title(title)
    for name, sim in sims.items():
        t = [s.t / 60 for s in sim.samples]
        line, = axes[1].plot(t, [s.prefill for s in sim.samples], label=f"{name} prefill")
        axes[1].plot(t, [s.decode for s in sim.samples], linestyle="--", color=line.get_color(),
                     label=f"{name} decode")
        axes[2].plot(t, [s.ttft_p if s.ttft_p is not None else math.nan for s in sim.samples], label=name)
        axes[3].plot(t, [s.itl_p * 1000 if s.itl_p is not None else math.nan for s in sim.samples], label=name)
    axes[1].set_ylabel("replicas")
    axes[1].legend(fontsize=7, ncol=3)
    axes[2].set_ylabel("TTFT p95 (s)")
    axes[2].axhline(ttft, color="red", linewidth=0.8)
    axes[2].set_yscale("log")
    axes[2].legend(fontsize=7)
    axes[3].set_ylabel("ITL p95 (ms)")
    axes[3].axhline(itl * 1000, color="red", linewidth=0.8)
    axes[3].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
