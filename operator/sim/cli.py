"""`phasesplit sim`: replay a workload through the autoscaler in simulated time.

Imports only argparse and the standard library at module level (runtime/cli.py loads every
plug-in to build its parser; heavy imports stay inside run()).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from phasesplit.runtime import units

ATTRIBUTION = ("Trace: Azure LLM inference trace 2023 (Azure Public Dataset, CC BY 4.0); Patel et al., "
               "\"Splitwise: Efficient generative LLM inference using phase splitting\", ISCA 2024.")

def _argument(parse, text: str, **kw):
    try:
        return parse(text, **kw)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_duration(text: str) -> float:
    """A duration flag: seconds, or with units (500ms, 2s, 10m)."""
    return _argument(units.parse_duration, text, bare_unit="s")


def parse_span(text: str) -> float:
    """A duration that may be zero (e.g. no warm-up)."""
    return _argument(units.parse_duration, text, bare_unit="s", allow_zero=True)


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=500ms,itl=50ms' (the bench tool's syntax; a bare number is milliseconds); both required."""
    return _argument(units.parse_slo, text, keys=("ttft", "itl"), require_all=True)


def parse_startup(text: str) -> dict[str, float]:
    """'15s' (both phases) or 'prefill=15s,decode=30s'."""
    if "=" not in text:
        t = _argument(units.parse_duration, text, bare_unit="s", allow_zero=True)
        return {"prefill": t, "decode": t}
    out = {}
    for part in text.split(","):
        phase, _, value = part.partition("=")
        if phase.strip() not in ("prefill", "decode"):
            raise argparse.ArgumentTypeError(f"--startup: unknown phase {phase.strip()!r} (prefill, decode)")
        out[phase.strip()] = _argument(units.parse_duration, value.strip(), bare_unit="s", allow_zero=True)
    return out


def _pair(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not PREFILL,DECODE: {text!r}") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError("replica counts must be ≥ 1")
    return p, d


def _schedule(text: str) -> list[tuple[float, int, int]]:
    from phasesplit.operator.sim.policies import parse_schedule

    try:
        return parse_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="steady",
                   help="steady | bursty | diurnal | shift | idle | a trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)")
    p.add_argument("--policy", choices=("planner", "static", "hpa-queue", "schedule"), default="planner")
    p.add_argument("--slo", type=parse_slo, default=parse_slo("ttft=500ms,itl=50ms"),
                   help="per-request targets, e.g. ttft=500ms,itl=50ms (ITL: the request's mean gap)")
    p.add_argument("--percentile", type=float, default=0.95, help="SLO percentile the planner sizes for")
    p.add_argument("--duration", type=parse_duration, default=None,
                   help="simulated time (generated default 1h; a trace: all of it)")
    p.add_argument("--rate", type=float, default=20.0, help="mean requests/s of generated workloads")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: compress time by this factor")
    p.add_argument("--token-scale", type=float, default=1.0, help="trace: multiply token counts")
    p.add_argument("--profile", default="a100-8b",
                   help="per-replica performance: a100-8b, cpu-smollm2, or a JSON file (see docs/autoscaling.md)")
    p.add_argument("--startup", type=parse_startup, default=None, metavar="DURATION|prefill=D,decode=D",
                   help="replica start-up (creation to ready), both phases or per phase; overrides the profile's")
    p.add_argument("--scale-to-zero", type=parse_duration, default=None, metavar="IDLE_AFTER",
                   help="planner: both phases may go to zero after this long idle (minReplicas 0, "
                        "scaleToZero.idleAfter); the router holds requests until they are back")
    p.add_argument("--prior-scale", type=float, default=1.0,
                   help="planner: start from a profile this many times too optimistic (calibration test)")
    p.add_argument("--interval", type=parse_duration, default=15.0, help="planner interval")
    p.add_argument("--max-replicas", type=int, default=32, help="per phase")
    p.add_argument("--static", type=_pair, default=None, metavar="P,D",
                   help="--policy static: these counts instead of the searched best")
    p.add_argument("--schedule", type=_schedule, default=None, metavar="T:P+D,...",
                   help="--policy schedule: counts ordered from time T on, e.g. 0:3+1,165:12+8,405:5+3 "
                        "(a clairvoyant bound for what a reactive planner could reach)")
    p.add_argument("--hpa-target", type=float, default=2.0, help="hpa-queue: waiting requests per pod")
    p.add_argument("--no-baselines", dest="baselines", action="store_false",
                   help="only the chosen policy (default: also best static and hpa-queue)")
    p.add_argument("--warmup", type=parse_span, default=120.0,
                   help="leave requests arriving in this first span (and its replica-seconds) out of the results")
    p.add_argument("--history", type=int, default=0, metavar="N",
                   help="replay the workload N times before the counted pass (every policy runs them; "
                        "only the last pass is counted): the planner as it runs after seeing this "
                        "traffic before, its burst memory and calibration learned, not a cold start")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="load, replicas per phase, TTFT and ITL over time")


def run(args: argparse.Namespace) -> int:
    from phasesplit.operator.sim.policies import HpaQueuePolicy, SchedulePolicy, StaticPolicy, make_planner
    from phasesplit.operator.sim.profile import load_profile
    from phasesplit.operator.sim.report import (
        Setup,
        best_static,
        initial_counts,
        plot,
        simulate,
        summarize,
        table,
    )
    from phasesplit.operator.sim.workload import GENERATED, generate, read_trace, replay

    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError) as e:
        print(f"phasesplit sim: profile {args.profile!r}: {e}", file=sys.stderr)
        return 2
    if args.startup:
        from dataclasses import replace

        profile = replace(profile, **{f"{ph}_startup_s": s for ph, s in args.startup.items()})
    is_trace = args.workload not in GENERATED
    if is_trace:
        if not os.path.exists(args.workload):
            print(f"phasesplit sim: workload {args.workload!r} is neither {', '.join(GENERATED)} nor a file",
                  file=sys.stderr)
            return 2
        try:
            requests = read_trace(args.workload, args.time_scale, args.token_scale, args.duration)
        except (OSError, ValueError) as e:
            print(f"phasesplit sim: {e}", file=sys.stderr)
            return 2
        duration = args.duration or (requests[-1].arrival if requests else 0.0)
        name = os.path.basename(args.workload)
    else:
        duration = args.duration or 3600.0
        requests = generate(args.workload, duration, args.rate, args.seed)
        name = args.workload
    if args.history < 0:
        print("phasesplit sim: --history must be ≥ 0", file=sys.stderr)
        return 2
    counted_from = 0.0
    if args.history:
        requests = replay(requests, duration, args.history + 1)
        counted_from = args.history * duration
        duration *= args.history + 1
    ttft, itl = args.slo["ttft"], args.slo["itl"]
    setup = Setup(requests, profile, ttft, itl, args.percentile, duration)

    def new_planner():
        return make_planner(profile, ttft, itl, args.percentile, args.max_replicas, args.interval, args.prior_scale,
                            args.scale_to_zero)

    start = initial_counts(setup, new_planner().planner)
    results, sims = {}, {}
    # After a replayed history the counted pass starts warm; else its first minutes are left out.
    warm = counted_from if args.history else min(args.warmup, duration / 4)
    # The planner runs unless only fixed counts were asked for (its attainment is the static
    # search's reference and every baseline is shown beside it).
    if args.policy != "static" or not args.static or args.baselines:
        sims["planner"] = simulate(setup, new_planner(), start, args.interval)
        results["planner"] = summarize(sims["planner"], "planner", name, warm)
    if args.policy == "schedule":
        if not args.schedule:
            print("phasesplit sim: --policy schedule needs --schedule T:P+D,...", file=sys.stderr)
            return 2
        first = args.schedule[0]
        sim = simulate(setup, SchedulePolicy(args.schedule), {"prefill": first[1], "decode": first[2]}, args.interval)
        results["schedule"] = summarize(sim, "schedule", name, warm)
        sims["schedule"] = sim
    if args.policy == "static" and args.static:
        p, d = args.static
        sim = simulate(setup, StaticPolicy(p, d), {"prefill": p, "decode": d}, args.interval)
        results["static"] = summarize(sim, "static", name, warm)
        results["static"]["static_replicas"] = {"prefill": p, "decode": d}
        sims["static"] = sim
    elif args.policy == "static" or args.baselines:
        reference = results["planner"]["attainment"]
        summary, sim, runs = best_static(setup, reference, args.max_replicas, args.interval, warm)
        summary["workload"] = name
        summary["search"] = {"reference_attainment": reference, "runs": runs}
        results["static"], sims["static"] = summary, sim
    if args.policy == "hpa-queue" or args.baselines:
        sim = simulate(setup, HpaQueuePolicy(args.hpa_target, args.max_replicas), start, 15.0)
        results["hpa-queue"] = summarize(sim, "hpa-queue", name, warm)
        sims["hpa-queue"] = sim
    chosen = dict(results[args.policy])
    chosen["slo"] = {"ttft_s": ttft, "itl_s": itl}
    chosen["profile"] = args.profile
    chosen["duration_s"] = duration
    chosen["warmup_s"] = warm
    if args.history:
        chosen["history"] = args.history
    if is_trace:
        chosen["scale"] = {"time": args.time_scale, "tokens": args.token_scale}
        chosen["attribution"] = ATTRIBUTION
    others = {k: v for k, v in results.items() if k != args.policy}
    if others:
        chosen["baselines"] = others
    if args.plot:
        plot(args.plot, sims, f"{name}: {', '.join(sims)} (SLO TTFT {ttft * 1000:.0f} ms, ITL {itl * 1000:.0f} ms)",
             ttft, itl)
    if args.json:
        print(json.dumps(chosen, indent=None))
    else:
        print(f"workload {name}: {len(requests)} requests over {duration:.0f} s; profile {args.profile}; "
              f"SLO TTFT {ttft * 1000:.0f} ms, ITL {itl * 1000:.0f} ms (both met = attained); "
              + (f"replayed {args.history + 1}x, only the last pass counted" if args.history
                 else f"first {warm:.0f} s left out (warm-up)"))
        print(table([results[k] for k in ("planner", "schedule", "static", "hpa-queue") if k in results]))
        if "static" in results and "search" in results["static"]:
            s = results["static"]["search"]
            print(f"static: cheapest fixed counts reaching the planner's attainment "
                  f"({s['reference_attainment'] * 100:.1f}%), {s['runs']} runs searched")
        held = results.get("planner", {}).get("held")
        if held:
            def sec(v):
                return "-" if v is None else f"{v:.1f}s"
            print(f"held by the router while a phase was at zero: {held['requests']} requests, {held['answered']} "
                  f"answered; TTFT p50 {sec(held['ttft_p50_s'])}, p95 {sec(held['ttft_p95_s'])}, max "
                  f"{sec(held['ttft_max_s'])} (start-up {max(profile.startup('prefill'), profile.startup('decode')):.0f}s "
                  f"+ interval {args.interval:.0f}s)")
        if is_trace:
            print(ATTRIBUTION)
    return 0
