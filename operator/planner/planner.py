"""The planner: one decision per interval from a metrics snapshot and the current replicas."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from phasesplit.operator.api import PHASES, Behavior
from phasesplit.operator.planner.behavior import HPA_BEHAVIOR, PhaseLimiter, apply_ratio
from phasesplit.operator.planner.bursts import BurstMemory
from phasesplit.operator.planner.clumps import ClumpMemory
from phasesplit.operator.planner.model import DecodeProfile, PerfModel, PrefillProfile
from phasesplit.operator.planner.queueing import replicas_for_ttft, service_quantile, ttft_quantile
from phasesplit.operator.planner.sizes import RequestSizes
from phasesplit.operator.planner.snapshot import MetricsSnapshot
from phasesplit.operator.planner.trend import RateTrend

# Healthy windows after which the prefill model's capacity is trusted over a miss's ratio.
CALIBRATED_WINDOWS = 8


@dataclass(frozen=True)
class PhaseLimits:
    min_replicas: int = 1
    max_replicas: int = 10


@dataclass(frozen=True)
class PlannerConfig:
    ttft_s: float = 0.5
    itl_s: float = 0.05
    percentile: float = 0.95  # the SLO is met when this quantile is within target
    prefill: PhaseLimits = PhaseLimits()
    decode: PhaseLimits = PhaseLimits()
    behavior: Behavior = field(default_factory=lambda: HPA_BEHAVIOR)
    min_pd_ratio: float | None = None  # prefill replicas per decode replica, lower bound
    max_pd_ratio: float | None = None
    interval_s: float = 15.0
    stale_after_s: float | None = None  # default: three intervals
    margin: float = 0.9  # size for this fraction of each target: room for noise and forecast error
    max_utilisation: float = 0.9  # prefill pool utilisation ceiling, whatever the queueing model says
    kv_headroom: float = 0.15  # free KV fraction kept on decode (bursts, prefix growth)
    kv_high: float = 0.92  # KV usage at which decode, not prefill, is blamed for TTFT
    prompt_scv: float = 1.0  # squared CV of prompt length, a prior (production traces: ≈0.9); fitted live
    max_miss_factor: float = 2.0  # largest one-step multiplier on an observed SLO miss
    tolerance: float = 0.1  # extra load a scale-down must still fit
    confirm_windows: int = 2  # consecutive windows a prediction-only scale-up must persist
    startup_s: float = 60.0  # a new replica's time to ready; with the interval, the reaction time
    surge_memory_s: float = 3600.0  # bursts older than this are forgotten, recurring or not
    burst_decay: float = 1.5  # burst headroom is kept this many longest inter-burst gaps after the last
    burst_first_hold_s: float = 900.0  # ... or this long after a first burst (no gap learned yet)
    max_surge: float = 3.0
    # Clumps of long prompts (clumps.py): TTFT misses where the queueing model gives at most this
    # share of the budget above service time to waiting are not queueing; the replica they buy
    # steps down one per clump_step_s without one.
    clump_queue: float = 0.1
    clump_step_s: float = 300.0
    # Scale to zero: a phase whose min_replicas is 0 goes to zero after this long with nothing
    # arriving, held, queued or running (None: never to zero, min 0 means 1).
    idle_after_s: float | None = None
    local_prefill: bool = False  # decode may prefill held prompts itself: wake decode alone

    @property
    def stale_after(self) -> float:
        return self.stale_after_s if self.stale_after_s is not None else 3 * self.interval_s


def _scaled(snap: MetricsSnapshot, rate: float) -> MetricsSnapshot:
    """The snapshot at another request rate with the same work per request."""
    if not snap.request_rate or rate == snap.request_rate:
        return snap
    k = rate / snap.request_rate
    return replace(snap, request_rate=rate, prompt_token_rate=(snap.prompt_token_rate or 0) * k,
                   generation_token_rate=(snap.generation_token_rate or 0) * k)


@dataclass(frozen=True)
class PhaseDecision:
    current: int
    recommended: int  # what the model asks for before behavior rules
    desired: int
    reason: str


@dataclass(frozen=True)
class Decision:
    prefill: PhaseDecision
    decode: PhaseDecision
    stale: bool
    predicted_ttft_s: float | None = None
    predicted_itl_s: float | None = None
    conditions: tuple[tuple[str, bool, str, str], ...] = ()  # (type, status, reason, message)

    @property
    def desired(self) -> dict[str, int]:
        return {"prefill": self.prefill.desired, "decode": self.decode.desired}

    @property
    def changed(self) -> bool:
        return any(p.desired != p.current for p in (self.prefill, self.decode))

    @property
    def reason(self) -> str:
        return f"prefill {self.prefill.current}→{self.prefill.desired}: {self.prefill.reason}; " \
               f"decode {self.decode.current}→{self.decode.desired}: {self.decode.reason}"


@dataclass
class Planner:
    """Keeps the calibrated model and the behavior history between decisions; no I/O."""

    config: PlannerConfig = field(default_factory=PlannerConfig)
    model: PerfModel = field(default_factory=lambda: PerfModel(PrefillProfile(), DecodeProfile()))
    stale_windows: int = 0
    idle_since: float | None = None  # start of the current stretch with no work at all (scale to zero)
    last_sizes: tuple[float | None, float | None] = (None, None)  # mean prompt/output tokens last seen
    woke_at: float | None = None  # when the phases were last woken from zero
    zero_note: str | None = None  # why the phases went to zero, kept as the message while they sleep
    decode_bound_before: bool = False
    kv_short_at: float | None = None  # the newest window that ended with decode KV-bound
    prefill_backlog_before: bool = False  # the previous window ended with a prefill backlog
    queue_before: float = 0.0  # prompt tokens queued for prefill at the previous window's end
    ready_prefill_before: int | None = None  # prefill replicas serving at the previous window's end
    missed_before: bool = False  # the previous window missed the TTFT target
    pace: str | None = None  # "sudden"/"gradual": how the remembered bursts rose (bursts.Headroom)

    def __post_init__(self) -> None:
        self.limiters = {p: PhaseLimiter(self.config.behavior) for p in PHASES}
        cfg = self.config
        self.bursts = BurstMemory(cfg.interval_s, cfg.startup_s + cfg.interval_s, memory_s=cfg.surge_memory_s,
                                  decay=cfg.burst_decay, first_hold_s=cfg.burst_first_hold_s,
                                  max_factor=cfg.max_surge)
        self.sizes = RequestSizes()
        self.trend = RateTrend()
        self.clumps = ClumpMemory(allowed=(1 - cfg.percentile) / 2, step_s=cfg.clump_step_s)

    def _typical(self, snap: MetricsSnapshot, rate: float) -> MetricsSnapshot:
        """The snapshot at `rate` with the recent mean request sizes instead of this window's:
        what capacity held for a remembered burst is sized from (one window's mean is noise)."""
        isl, osl = self.sizes.prompt() or snap.mean_prompt_tokens, self.sizes.output() or snap.mean_generated_tokens
        if not isl or osl is None:
            return _scaled(snap, rate)
        return replace(snap, request_rate=rate, prompt_tokens_mean=isl, generated_tokens_mean=osl,
                       prompt_token_rate=rate * isl, generation_token_rate=rate * osl)

    def use_startup(self, seconds: float) -> None:
        """Take a measured replica start-up (pod creation to Ready, the operator's rolling median)
        as the reaction time, instead of the configured one: how far ahead a scale-up must look
        (drain projections, burst extrapolation, the backlog a wake-up meets)."""
        if seconds != self.config.startup_s:
            self.config = replace(self.config, startup_s=seconds)
            self.bursts.reaction_s = seconds + self.config.interval_s

    def surge(self, now: float, rate: float, short: bool = False) -> tuple[float, float, bool, str]:
        """(planning rate, surge factor, rising, note): headroom for load that can arrive before a
        new replica is up.

        The burst memory (bursts.py) keeps capacity for the remembered bursts' peak while bursts
        keep recurring, and lets go when they stop; a load that drifts slowly (diurnal) or only
        jitters (steady) has no bursts and gets none.

        While a burst is still under way (the newest smoothed rate is its peak so far) and already
        outruns the capacity (`short`: an SLO miss or a queue now), its peak is not known yet: the
        rise so far is extrapolated over one more reaction time, capped at `max_surge` times the
        lowest rate of that reaction time. Sizing only for the rate seen so far would order, a
        reaction time late, capacity that is already too small. A rise the capacity still absorbs
        gets only the remembered headroom.
        """
        cfg, mem = self.config, self.bursts
        mem.observe(now, rate)
        h = mem.headroom(now, rate)
        ceiling, rising = h.rate, False
        if short and h.rising and h.factor > 1:
            # (the latest time the low was seen: where the rise started)
            t_low, low = min(mem.rates, key=lambda x: (x[1], -x[0]))
            t_new, newest = mem.rates[-1]
            if t_new > t_low and newest - low > mem.noise(low):
                rising = True
                pace = (newest - low) / (t_new - t_low)
                ceiling = max(ceiling, min(newest + pace * mem.reaction_s, low * cfg.max_surge))
        self.pace = "sudden" if h.sudden else "gradual" if h.gradual else None
        return max(rate, min(rate * h.factor, ceiling)), h.factor, rising, h.note

    def plan(self, snap: MetricsSnapshot | None, current: dict[str, int], now: float) -> Decision:
        """The decision for this interval: scale to zero and back (when allowed), else size."""
        zero = [p for p in PHASES if self.config.idle_after_s is not None
                and {"prefill": self.config.prefill, "decode": self.config.decode}[p].min_replicas == 0]
        if not zero:
            return self._plan(snap, current, now)
        return self._plan_with_zero(snap, current, now, zero)

    def _plan_with_zero(self, snap: MetricsSnapshot | None, current: dict[str, int], now: float,
                        zero: list[str]) -> Decision:
        """Scale-to-zero around the sizing: idle phases go to zero after `idle_after_s` with nothing
        arriving, held, queued or running; requests held by the router (or arriving) wake them.

        A phase at zero has no pods and so no metrics; the router (always ≥ 1 replica) still
        counts arrivals and the requests it holds for want of a worker, and those wake the
        phases at once, past the behavior rules (a Percent policy can never scale up from 0, and
        a held request waits for the whole start-up already). A held request needs a decode
        worker and a prefill worker (unless decode may prefill locally): both come back together.
        """
        cfg = self.config
        fresh = snap is not None and now - snap.timestamp <= cfg.stale_after and snap.request_rate is not None
        if fresh and snap.mean_prompt_tokens and snap.mean_generated_tokens:
            self.last_sizes = (snap.mean_prompt_tokens, snap.mean_generated_tokens)
        held = (snap.held_requests or 0.0) if snap is not None else 0.0
        busy = snap is not None and any((x or 0) > 0 for x in (
            held, snap.request_rate, snap.decode_running, snap.decode_waiting, snap.prefill_queue_tokens,
            snap.prefill_waiting))
        if busy or not fresh:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = snap.timestamp - snap.window_s  # the whole window was idle
        asleep = [p for p in zero if current[p] == 0]
        if asleep and busy:
            need = ["decode"] if cfg.local_prefill else list(PHASES)
            size = self._wake_size(snap, held)
            want = {p: max(current[p], size[p]) if p in need else current[p] for p in PHASES}
            what = f"{held:.0f} held request{'s' * (held != 1)}" if held else f"{snap.request_rate:.2f} req/s arriving"
            self.woke_at = now
            phases = {}
            for p in PHASES:
                self.limiters[p].record(now, current[p], want[p])
                why = f"woken by {what}" if want[p] != current[p] else "awake"
                phases[p] = PhaseDecision(current[p], want[p], want[p], why)
            return Decision(phases["prefill"], phases["decode"], stale=False,
                            conditions=(("ScaledToZero", False, "Woken", f"woken by {what}"),))
        if asleep and not busy:
            # The message stays what it was when the phases went to zero: a status that changed every
            # interval ("idle 75s", "idle 90s", ...) would cost one status write per interval for
            # every sleeping service; how long it has slept is the condition's lastTransitionTime.
            msg = (self.zero_note if fresh and self.zero_note
                   else "at zero" if fresh
                   else "at zero, no fresh metrics (the router reports arrivals and held requests)")
            phases = {p: PhaseDecision(current[p], current[p], current[p] if p in asleep else max(current[p], 1), msg)
                      for p in PHASES}
            return Decision(phases["prefill"], phases["decode"], stale=not fresh,
                            conditions=(("ScaledToZero", True, "Idle", msg),))
        if self.woke_at is not None and now - self.woke_at <= cfg.startup_s + 2 * cfg.interval_s and fresh:
            # The held requests' TTFT (start-up and all) lands in the windows after a wake-up: the
            # price of zero, not a capacity miss (a queue still left is seen as a queue).
            snap = replace(snap, ttft_p=None, ttft_mean=None)
        d = self._plan(snap, current, now)
        idle = now - self.idle_since if self.idle_since is not None else 0.0
        if self.idle_since is not None and idle >= cfg.idle_after_s:
            msg = f"scaled to zero after {idle:.0f}s idle (idleAfter {cfg.idle_after_s:.0f}s)"
            self.zero_note = msg
            for p in zero:
                self.limiters[p].record(now, current[p], 0)
            d = replace(d, **{p: PhaseDecision(current[p], 0, 0, msg) for p in zero},
                        conditions=d.conditions + (("ScaledToZero", True, "Idle", msg),))
        return d

    def _wake_size(self, snap: MetricsSnapshot, held: float) -> dict[str, int]:
        """Replicas to wake with: by the time they are up, the router holds what it holds now plus
        one start-up of arrivals; those must drain within one interval on top of the arrivals
        (one replica per phase would serve that backlog one prompt after another)."""
        cfg = self.config
        rate = snap.request_rate or 0.0
        backlog = held + rate * cfg.startup_s
        out = {"prefill": 1, "decode": 1}
        # A phase at zero reports nothing: request sizes the router did not see this window are
        # the last ones seen while awake.
        isl = snap.mean_prompt_tokens or self.last_sizes[0]
        osl = snap.mean_generated_tokens or self.last_sizes[1]
        if isl and osl and backlog > 0:
            snap = replace(snap, prompt_tokens_mean=isl, generated_tokens_mean=osl,
                           prompt_token_rate=rate * isl, generation_token_rate=rate * osl)
            surge = replace(_scaled(snap, rate + backlog / cfg.interval_s), prefill_queue_tokens=0.0,
                            decode_running=0.0, decode_waiting=0.0, kv_usage=None, ready_prefill=None,
                            ready_decode=None)
            out["prefill"] = max(1, self._prefill_throughput(surge))
            out["decode"] = max(1, self._size_decode(surge)[0])
        return {p: min(n, (cfg.prefill if p == "prefill" else cfg.decode).max_replicas) for p, n in out.items()}

    def _plan(self, snap: MetricsSnapshot | None, current: dict[str, int], now: float) -> Decision:
        cfg = self.config
        limits = {"prefill": cfg.prefill, "decode": cfg.decode}
        if snap is None or now - snap.timestamp > cfg.stale_after or snap.request_rate is None:
            return self._hold(snap, current, now, limits)
        self.stale_windows = 0
        # Prompts queued for prefill at both ends of a window that missed its TTFT target, the
        # queue held (it did not drain by more than a prompt: arrivals kept pace with the pool),
        # and decode did not hold it back: the pool was busy all through the window, so what it
        # served bounds its capacity (a prior far too high would otherwise see that queue drain by
        # itself, and never learn otherwise: calibration below waits for healthy windows).
        # The same replicas at both ends, too: one that came up mid-window served part of it.
        queue, isl = snap.prefill_queue_tokens or 0.0, snap.mean_prompt_tokens or 0.0
        busy = (isl > 0 and min(queue, self.queue_before) >= isl and queue >= self.queue_before - isl
                and snap.ttft_p is not None and snap.ttft_p > cfg.ttft_s
                and snap.ready_prefill == self.ready_prefill_before and not self._bottlenecks(snap)[1])
        self.queue_before, self.ready_prefill_before = queue, snap.ready_prefill
        calibration = self.model.bound_prefill(snap) if busy else []
        # Calibrate on healthy windows only: in a window that missed, TTFT holds waits (for KV,
        # behind a backlog) the model does not describe, and would teach it a wrong capacity.
        healthy = (snap.ttft_p is None or snap.ttft_p <= cfg.ttft_s) and not any(self._bottlenecks(snap))
        if healthy:
            calibration += self.model.calibrate(snap, cfg.prompt_scv, cfg.kv_high, cfg.percentile)

        self.sizes.observe(snap.request_rate * snap.window_s, snap.mean_prompt_tokens, snap.mean_generated_tokens)
        # The queues at the window's end, against the model as calibrated now (nothing below changes it).
        prefill_backlog, decode_bound = self._bottlenecks(snap)
        short = (snap.ttft_p is not None and snap.ttft_p > cfg.ttft_s) or prefill_backlog or decode_bound
        plan_rate, surge, rising, memory_note = self.surge(now, snap.request_rate, short)
        # A steady rise (not a burst: the memory has none open) is sized where it will be when
        # replicas ordered now are up.
        self.trend.observe(now, snap.request_rate)
        line = self.trend.rise(now, self.bursts.reaction_s)
        trend_note = ""
        if line is not None and line[1] > plan_rate and not self.bursts.in_burst():
            slope, plan_rate = line
            trend_note = (f" (rising {slope * 60:.1f} req/s per min: sized for {plan_rate:.1f} req/s "
                          f"{self.bursts.reaction_s:.0f}s ahead)")
        # Burst headroom is throughput, not latency: a burst that arrives finds capacity that
        # carries its peak (prefill at ≤ max_utilisation) while more replicas start, and queues
        # briefly; sizing the lulls for the peak's TTFT quantile would pay for the burst's
        # latency through every lull. A burst under way (rising) is sized in full.
        prefill_rate = plan_rate if rising or trend_note else snap.request_rate
        rec_p, why_p, ttft_pred, ttft_ok = self._size_prefill(_scaled(snap, prefill_rate))
        decode_snap = _scaled(snap, plan_rate)
        if trend_note and snap.request_rate:
            # What runs on decode grows with the rate: the running batch and the KV in use (floors
            # of the sizing, measured now) are projected along the same line.
            k = plan_rate / snap.request_rate
            decode_snap = replace(self._typical(snap, plan_rate), decode_running=(snap.decode_running or 0.0) * k,
                                  kv_usage=None if snap.kv_usage is None else snap.kv_usage * k)
        rec_d, why_d, itl_pred = self._size_decode(decode_snap)
        # Tolerance against flapping (HPA's is 10 %): a phase shrinks only if it would still
        # shrink with that much more load than measured. It guards against noise in the measured
        # rate; a surge plan is a remembered peak, not a noisy measurement, and is not inflated.
        tolerant = snap.request_rate * (1 + cfg.tolerance)
        if rec_p < current["prefill"]:
            rec_p = max(rec_p, min(current["prefill"], self._size_prefill(_scaled(snap, max(prefill_rate, tolerant)))[0]))
        if rec_d < current["decode"]:
            rec_d = max(rec_d, min(current["decode"], self._size_decode(_scaled(snap, max(plan_rate, tolerant)))[0]))
        if surge > 1 and not rising:
            # Inside a recurring burst one window's rate scatters around the level its predecessors
            # held; a reading within noise (3σ of one window's Poisson count) of that level is that
            # level, not a taller burst (sized from the reading, every burst's noisiest window
            # bought a replica that the scale-down window then kept five minutes).
            carry_rate, level = plan_rate, self.bursts.level()
            if level is not None and level < carry_rate <= level + 3 * math.sqrt(level / cfg.interval_s):
                carry_rate = level
            peak = self._typical(snap, carry_rate)
            carry, how = self._prefill_throughput(peak), "carried at the burst peak"
            if self.pace == "sudden":
                # Bursts rise faster than replicas start: the peak must find its TTFT met.
                carry, how = max(carry, self._size_prefill(peak)[0]), "at the burst peak, which rises within a start-up"
            # A burst that rises slower than replicas start is met by scaling up as it rises; through
            # it and the lulls, carrying the remembered peak's throughput is enough (the latency
            # model, FCFS, overstates the tail near full utilisation; queues and misses still act).
            if carry > rec_p or self.pace == "gradual":
                rec_p, why_p = carry, f"{carry_rate * (self.sizes.prompt() or 0):.0f} prompt tok/s {how}"
        if trend_note:
            why_p += trend_note
            why_d += trend_note
        elif plan_rate > snap.request_rate:
            note = f" (surge headroom ×{surge:.2f}: sized for {plan_rate:.1f} req/s; {memory_note})"
            why_p += note
            why_d += note
        urgent = {"prefill": False, "decode": False}
        # The queueing model is FCFS; the runtime serves shortest remaining prompt first, so near
        # full utilisation the model overstates the TTFT tail (the fitted prompt SCV only matches it
        # at the loads it was fitted on). When every replica serves, nothing is queued and the TTFT
        # observed at this very load is within the sizing target, the observation refutes a
        # prediction that asks for more: hold (a miss or a queue next window acts at once).
        observed_ok = (snap.ttft_p is not None and snap.ttft_p <= cfg.ttft_s * cfg.margin and not prefill_backlog
                       and snap.ready_prefill == current["prefill"] and not rising
                       and (snap.request_rate or 0) * cfg.interval_s >= self.model.min_requests)
        if observed_ok and rec_p > current["prefill"] and prefill_rate <= snap.request_rate:
            rec_p, why_p = current["prefill"], (f"TTFT p{cfg.percentile * 100:g} {snap.ttft_p * 1000:.0f}ms observed "
                                                f"at this load on {current['prefill']} (model asked {rec_p}: {why_p})")
        # Queueing shows in the queues before it shows in TTFT (a request reaches the TTFT
        # histogram only once its first token is out): a backlog the current replicas cannot
        # clear within the wait budget, or requests blocked on decode KV, act like a miss.
        # The model's sizing already includes draining that backlog; it is applied at once.
        if prefill_backlog and rec_p > current["prefill"]:
            urgent["prefill"] = True
        if decode_bound and rec_d > current["decode"]:
            urgent["decode"] = True
        # A rise beyond noise that is still under way needs no second window to confirm it:
        # waiting one more interval puts the new replicas that much further behind the load.
        if rising:
            urgent["prefill"] |= rec_p > current["prefill"]
            urgent["decode"] |= rec_d > current["decode"]
        # An SLO already missed beats any model (a prior can be far off, and calibration waits
        # for healthy windows): scale the phase responsible at once, in proportion to the miss,
        # from the replicas actually serving (those still starting are on their way). TTFT
        # covers every wait before the first token, so the miss goes to the phase whose queue
        # explains it (prefill backlog, KV exhaustion, or both; prefill when neither). Only the
        # queueing part of TTFT responds to replicas, so the miss is measured against the wait
        # budget left after a long prompt's own service time; a miss that service time alone
        # explains (the window's longest prompts) buys nothing.
        floor = self._prefill_floor(snap)
        carried = (plan_rate > snap.request_rate and not rising and snap.ready_prefill is not None
                   and snap.ready_prefill >= self._prefill_throughput(self._typical(snap, plan_rate)))
        # KV exhaustion that ended in the previous window still shows in this window's TTFT
        # (those requests got their first token late): already answered, not prefill's miss.
        decode_recovered = self.decode_bound_before and not decode_bound
        self.decode_bound_before = decode_bound
        # Likewise a prefill backlog that drained by this window's end: the window's TTFT holds the
        # requests that waited in it (the replicas ordered for it are serving or on their way), so
        # a miss with no queue left is that backlog's past, not a model that is off.
        prefill_recovered = self.prefill_backlog_before and not prefill_backlog
        self.prefill_backlog_before = prefill_backlog
        missed_before, self.missed_before = self.missed_before, snap.ttft_p is not None and snap.ttft_p > cfg.ttft_s
        # Requests that waited for KV get their first tokens (late) for a while after the cache
        # frees up: for a reaction time after a KV shortage, misses are its past.
        if decode_bound:
            self.kv_short_at = now
        kv_past = self.kv_short_at is not None and now - self.kv_short_at <= self.bursts.reaction_s
        if (snap.ttft_p is not None and snap.ttft_p > cfg.ttft_s and cfg.ttft_s - floor > 0.2 * cfg.ttft_s
                and not (decode_recovered and not prefill_backlog)):
            factor = min((snap.ttft_p - floor) / (cfg.ttft_s - floor), cfg.max_miss_factor)
            miss = f"TTFT p{cfg.percentile * 100:g} {snap.ttft_p * 1000:.0f}ms > {cfg.ttft_s * 1000:.0f}ms"
            if decode_bound:
                # The sizing already drains the requests waiting for KV (they are its backlog); the
                # miss adds at least one replica, not the miss's ratio: KV per replica is known
                # exactly, and a window's TTFT is the past (requests that already waited).
                want = max(rec_d, (snap.ready_decode or current["decode"]) + 1)
                if want > current["decode"]:
                    rec_d, why_d, urgent["decode"] = want, f"{miss} with KV full: {why_d}", True
            if prefill_backlog:
                # The queue is there to see: size for draining it, not for the size of the miss. The
                # TTFT of a window is the past (requests that already waited); what more replicas
                # can change is the queue that is left when they are up.
                want, why = self._drain_prefill(snap, plan_rate, current["prefill"])
                if want > rec_p:
                    rec_p, why_p, urgent["prefill"] = want, f"{miss}; {why}", True
            elif (not decode_bound and not kv_past and not (snap.decode_waiting or 0) > 0 and not carried
                  and not prefill_recovered):
                # No queue explains the miss: the model is off (a prior far from the truth, not yet
                # calibrated). Trust the observation, in proportion to it. Not while a remembered
                # burst's peak is already carried by the replicas serving: that miss is the burst's
                # brief queue at its rise, which the held capacity drains by itself.
                # Nor within a reaction time of a KV shortage (kv_past): its waiters are still
                # getting their first tokens, late, from prefill replicas with no queue.
                serving = snap.ready_prefill or current["prefill"]
                want = math.ceil(serving * factor)
                how = f"×{factor:.2f}"
                if self.model.prefill_samples >= CALIBRATED_WINDOWS:
                    # A calibrated model that still misses is off by a little, not by the miss's
                    # ratio (a pool near full utilisation misses its tail by far more than its
                    # capacity is short): one more replica, and the next window says if it was enough.
                    want, how = min(want, serving + 1), "+1 (model calibrated)"
                    if not missed_before:
                        # ...and one window's tail (a p95 of a few hundred requests) is noise
                        # until the next window misses too.
                        want, how = current["prefill"], "one window's miss, calibrated model: watching"
                if want > rec_p:
                    rec_p, why_p, urgent["prefill"] = want, f"{miss}: {how}", True
            # Requests waiting on a decode worker whose queue is stranded there (KV not short
            # overall) explain the miss too; no replica added now would serve them sooner.
        # Requests that missed where the model sees almost no queueing, with no queue, KV shortage,
        # rate burst or rise to explain it: clumps of long prompts at an ordinary rate (clumps.py). While they
        # keep spending the SLO's budget, one replica more than served them is kept. A window of
        # a few requests says nothing (the last two of a drained backlog would buy a replica).
        served = snap.request_rate * snap.window_s
        serving = max(snap.ready_prefill or current["prefill"], 1)
        load = (snap.prompt_token_rate or 0.0) / (serving * self.model.prefill.tokens_per_s)
        unexplained = (snap.ttft_attainment is not None and snap.ttft_attainment < 1.0
                       and served >= self.model.min_requests
                       # (a clump is at most the window's prompts arriving at once: its last first
                       # token comes within the window's work on the pool; a TTFT tail far beyond
                       # that is waits of another kind, already past)
                       and (snap.ttft_p is None or snap.ttft_p <= max(cfg.ttft_s, floor + load * snap.window_s))
                       and cfg.ttft_s - floor > 0.2 * cfg.ttft_s and not prefill_backlog and not prefill_recovered
                       and not kv_past and not (snap.decode_waiting or 0) > 0
                       and not (snap.itl_p is not None and snap.itl_p > cfg.itl_s) and not rising and not trend_note
                       # last: the one test that integrates the queueing model
                       and self._queue_share(snap, serving, floor) <= cfg.clump_queue)
        missed = served * (1 - snap.ttft_attainment) if unexplained else 0.0
        self.clumps.observe(now, served, missed, serving)
        held = self.clumps.floor()
        if held is not None and held > rec_p:
            rec_p, urgent["prefill"] = min(held, cfg.prefill.max_replicas), held > current["prefill"]
            why_p = (f"clumps of long prompts: windows at an ordinary rate with no queue left missed for "
                     f">{self.clumps.allowed * 100:g} % of their requests; keeping {held}")
        if snap.itl_p is not None and snap.itl_p > cfg.itl_s:
            factor = min(snap.itl_p / cfg.itl_s, cfg.max_miss_factor)
            want = math.ceil((snap.ready_decode or current["decode"]) * factor)
            if want > rec_d:
                rec_d, urgent["decode"] = want, True
                why_d = f"ITL p{cfg.percentile * 100:g} {snap.itl_p * 1000:.1f}ms > {cfg.itl_s * 1000:.0f}ms: ×{factor:.2f}"

        rec_p, rec_d, ratio_note = apply_ratio(rec_p, rec_d, cfg.min_pd_ratio, cfg.max_pd_ratio,
                                               cfg.prefill.max_replicas, cfg.decode.max_replicas)
        out = {}
        for phase, rec, why in (("prefill", rec_p, why_p), ("decode", rec_d, why_d)):
            lim = limits[phase]
            confirm = (cfg.confirm_windows - 0.5) * cfg.interval_s if cfg.confirm_windows > 1 else 0.0
            desired, note = self.limiters[phase].apply(now, current[phase], rec, lim.min_replicas,
                                                       lim.max_replicas, urgent[phase], confirm)
            out[phase] = [rec, desired, "; ".join(x for x in (why, note) if x)]
        # Rate limits may have moved one phase more than the other; restore the ratio by raising.
        p, d, late_note = apply_ratio(out["prefill"][1], out["decode"][1], cfg.min_pd_ratio,
                                      cfg.max_pd_ratio, cfg.prefill.max_replicas, cfg.decode.max_replicas)
        for phase, value in (("prefill", p), ("decode", d)):
            if value != out[phase][1]:
                self.limiters[phase].record(now, out[phase][1], value)
                out[phase][1] = value
        for note in (ratio_note, late_note):
            if note:
                phase = "prefill" if note.startswith("prefill") else "decode"
                out[phase][2] += f"; {note}"
        if calibration:
            out["prefill"][2] += f" (calibrated: {', '.join(calibration)})"
        conditions = [("MetricsAvailable", True, "Fresh", f"window {snap.window_s:.0f}s")]
        if not ttft_ok:
            conditions.append(("SLOReachable", False, "PromptTooLong",
                               "long prompts' service time alone nears the TTFT target; scaling out "
                               "only shortens their queue"))
        return Decision(
            prefill=PhaseDecision(current["prefill"], *out["prefill"]),
            decode=PhaseDecision(current["decode"], *out["decode"]),
            stale=False, predicted_ttft_s=ttft_pred, predicted_itl_s=itl_pred,
            conditions=tuple(conditions))

    def _queue_share(self, snap: MetricsSnapshot, serving: int, floor: float) -> float:
        """The share of the TTFT budget above a long prompt's own service time that the queueing
        model gives to waiting, at this window's rate on the replicas that served it."""
        cfg, prof = self.config, self.model.prefill
        isl = snap.mean_prompt_tokens
        if not isl or not snap.request_rate or cfg.ttft_s <= floor:
            return math.inf
        t = ttft_quantile(serving, snap.request_rate, isl, prof.tokens_per_s, prof.overhead_s,
                          self.model.scv(cfg.prompt_scv), cfg.percentile)
        return max(t - floor, 0.0) / (cfg.ttft_s - floor)

    def _drain_prefill(self, snap: MetricsSnapshot, rate: float, current: int) -> tuple[int, str]:
        """Prefill replicas that drain the queue a new replica would still find when it is up.

        Replicas ordered now serve one start-up (plus an interval) from now. By then the ready
        replicas have worked on the queue while arrivals added to it; only what is left then,
        drained within one interval on top of the arrivals, needs replicas beyond the current
        count. A queue the serving replicas clear before then asks for nothing more.
        """
        cfg, prof = self.config, self.model.prefill
        isl = snap.mean_prompt_tokens or 0.0
        queue = snap.prefill_queue_tokens or 0.0
        arriving = rate * isl
        ready = snap.ready_prefill or current
        capacity = prof.tokens_per_s
        lead = cfg.startup_s + cfg.interval_s
        left = queue + (arriving - ready * capacity) * lead
        if left <= 0:
            return 0, f"backlog {queue:.0f} tok drains on {ready} serving replicas before more could start"
        want = math.ceil((arriving + left / cfg.interval_s) / capacity)
        return want, (f"backlog {queue:.0f} tok grows to {left:.0f} by the time replicas ordered now are up; "
                      f"draining it within {cfg.interval_s:.0f}s")

    def _bottlenecks(self, snap: MetricsSnapshot) -> tuple[bool, bool]:
        """(prefill backlogged, decode KV-bound) from the queues of the window's end.

        In split mode a request holds its decode KV reservation while it queues for prefill, so
        a full KV cache with a long prefill queue is a prefill problem; decode is to blame only
        when its running requests alone fill the cache.
        """
        cfg, model = self.config, self.model
        budget = max(cfg.ttft_s - self._prefill_floor(snap), 0.2 * cfg.ttft_s)
        ready_p = snap.ready_prefill or 1
        queue_wait = (snap.prefill_queue_tokens or 0.0) / (ready_p * model.prefill.tokens_per_s)
        prefill_backlog = queue_wait > 0.5 * budget
        isl, osl = snap.mean_prompt_tokens or 0.0, snap.mean_generated_tokens or 0.0
        running_frac = ((snap.decode_running or 0.0) * (isl + osl)
                        / ((snap.ready_decode or 1) * model.decode.kv_capacity_tokens))
        decode_bound = self._kv_short(snap) and (not prefill_backlog or running_frac >= 1 - cfg.kv_headroom)
        return prefill_backlog, decode_bound

    def _kv_short(self, snap: MetricsSnapshot) -> bool:
        """Decode KV is short: the cache is (nearly) full, or requests wait for it while it is.

        The router binds a request to a decode worker on arrival, and the worker queues it until
        its blocks fit; a queue on one full worker while the others have room (mean usage well
        below full) is stranded there, and new replicas would only get new arrivals: not a
        shortage. Without a usage figure, any waiting request counts.
        """
        cfg = self.config
        waiting = (snap.decode_waiting or 0) > 0
        if snap.kv_usage is None:
            return waiting
        return snap.kv_usage >= cfg.kv_high or (waiting and snap.kv_usage >= 1 - cfg.kv_headroom)

    def _prefill_floor(self, snap: MetricsSnapshot) -> float:
        """TTFT at the SLO percentile with no queue at all: the service time of a long prompt."""
        isl = snap.mean_prompt_tokens
        if not isl:
            return 0.0
        prof = self.model.prefill
        return prof.overhead_s + service_quantile(isl / prof.tokens_per_s, self.model.scv(self.config.prompt_scv),
                                                  self.config.percentile)

    def _size_prefill(self, snap: MetricsSnapshot) -> tuple[int, str, float | None, bool]:
        cfg, prof = self.config, self.model.prefill
        rate, isl = snap.request_rate or 0.0, snap.mean_prompt_tokens
        if rate <= 0 or not isl:
            return cfg.prefill.min_replicas, "no traffic", None, True
        # A backlog already queued must drain within one interval on top of new arrivals;
        # expressed as extra arrivals of the mean prompt so the same queueing model sizes it.
        backlog_rate = (snap.prefill_queue_tokens or 0.0) / isl / cfg.interval_s
        arrivals = rate + backlog_rate
        c, predicted, ok = replicas_for_ttft(arrivals, isl, prof.tokens_per_s, prof.overhead_s,
                                             self.model.scv(cfg.prompt_scv),
                                             cfg.percentile, cfg.ttft_s * cfg.margin, cfg.max_utilisation,
                                             cfg.prefill.max_replicas)
        why = (f"{rate * isl:.0f} prompt tok/s"
               + (f" + backlog {snap.prefill_queue_tokens:.0f} tok" if backlog_rate > 0 else "")
               + f" at {prof.tokens_per_s:.0f} tok/s/replica → TTFT p{cfg.percentile * 100:g} "
               f"≈{predicted * 1000:.0f}ms with queueing")
        return c, why, predicted, ok

    def _prefill_throughput(self, snap: MetricsSnapshot) -> int:
        """Replicas that carry the snapshot's prompt tokens at ≤ max_utilisation (no latency target)."""
        cfg, prof = self.config, self.model.prefill
        rate, isl = snap.request_rate or 0.0, snap.mean_prompt_tokens or 0.0
        busy = rate * (isl / prof.tokens_per_s + prof.overhead_s)
        return min(max(math.ceil(busy / cfg.max_utilisation - 1e-9), cfg.prefill.min_replicas, 1),
                   cfg.prefill.max_replicas)

    def _size_decode(self, snap: MetricsSnapshot) -> tuple[int, str, float | None]:
        cfg, model = self.config, self.model
        rate = snap.request_rate or 0.0
        isl, osl = snap.mean_prompt_tokens, snap.mean_generated_tokens
        running = snap.decode_running or 0.0
        # Requests waiting for KV join over the next interval: extra arrivals, like prefill's backlog
        # (unless they are stranded on one full worker while the others have room).
        backlog_rate = (snap.decode_waiting or 0.0) / cfg.interval_s if self._kv_short(snap) else 0.0
        if rate <= 0 or isl is None or osl is None:
            if running > 0:
                return max(cfg.decode.min_replicas, snap.ready_decode or 1), "requests still running", None
            return cfg.decode.min_replicas, "no traffic", None
        if isl + osl <= 0:
            # First tokens seen at the front but no token counts moved on the workers this window
            # (their scrapes are not simultaneous): nothing to size by, so hold what is ready.
            return max(cfg.decode.min_replicas, snap.ready_decode or 1), "no token counts this window", None
        context = isl + osl / 2  # mean context over a request's decode life
        # KV demand per request: the seeds' formula, 2·layers·kv_heads·head_dim·bytes·context,
        # with the context at its end (prompt + all generated tokens): blocks are held until then.
        # If the runtime reports more KV in use than that predicts (prefix blocks, fragmentation),
        # believe the runtime.
        kv_per_req = isl + osl
        # Long requests stay longer, so the running batch holds more than the mean request's
        # KV (the inspection paradox); the runtime's KV usage per running request measures that
        # directly. Trusted only when decode is not also holding reservations for a prefill backlog.
        prefill_backlog, _ = self._bottlenecks(snap)
        if (snap.kv_usage is not None and snap.ready_decode and (snap.decode_running or 0) >= 10
                and not prefill_backlog):
            per_running = snap.kv_usage * model.decode.kv_capacity_tokens * snap.ready_decode / snap.decode_running
            kv_per_req = max(kv_per_req, min(per_running, 3 * (isl + osl)))
        # What the runtime reports in use now (including blocks reserved for prompts still in
        # prefill, fragmentation, prefix blocks) is a floor: never size below it plus headroom.
        # Not while prefill is backlogged: then the cache holds the reservations of prompts still
        # queued for prefill (bound to a decode worker on arrival), which leave as the queue drains;
        # decode replicas bought for them arrive after the queue is gone.
        in_use = 0.0
        if snap.kv_usage is not None and snap.ready_decode:
            in_use = snap.kv_usage * model.decode.kv_capacity_tokens * snap.ready_decode
        usable = model.decode.kv_capacity_tokens * (1 - cfg.kv_headroom)
        kv_batch = usable / kv_per_req
        itl_batch = model.max_batch_for_itl(cfg.itl_s * cfg.margin, context)
        per_replica = max(1.0, min(kv_batch, itl_batch, float(model.decode.max_batch)))
        limit = "KV" if kv_batch <= itl_batch else "ITL"
        # Concurrency by Little's law, N = λ·OSL·ITL, where ITL itself depends on the batch:
        # find the fewest replicas whose batch both fits and yields the ITL assumed.
        d, concurrency, step = cfg.decode.min_replicas, running, model.step_time(1, context)
        for d in range(max(1, cfg.decode.min_replicas), cfg.decode.max_replicas + 1):
            step = model.step_time(per_replica, context)
            for _ in range(8):
                concurrency = max((rate + backlog_rate) * osl * step, running)
                step = model.step_time(concurrency / d, context)
            if concurrency / d <= per_replica and in_use / d <= usable:
                break
        why = (f"{concurrency:.0f} concurrent × {kv_per_req:.0f} KV tok, ≤{per_replica:.0f}/replica "
               f"({limit}-bound) → ITL ≈{step * 1000:.1f}ms")
        return d, why, step

    def _hold(self, snap: MetricsSnapshot | None, current: dict[str, int], now: float,
              limits: dict[str, PhaseLimits]) -> Decision:
        """Stale or missing metrics: keep the count (within bounds, never zero) and say so."""
        self.stale_windows += 1
        if snap is None or snap.request_rate is None:
            msg = "no metrics"
        else:
            msg = f"metrics {now - snap.timestamp:.0f}s old (limit {self.config.stale_after:.0f}s)"
        msg += f"; holding replicas ({self.stale_windows} window{'s' * (self.stale_windows != 1)})"
        phases = {}
        for phase in PHASES:
            lim = limits[phase]
            held = min(max(current[phase], lim.min_replicas, 1), lim.max_replicas)
            phases[phase] = PhaseDecision(current[phase], current[phase], held, msg)
        return Decision(phases["prefill"], phases["decode"], stale=True,
                        conditions=(("MetricsAvailable", False, "MetricsStale", msg),))
