"""Rolling estimates of what work costs here: seconds ≈ base + per_token × tokens. Pure.

The engine feeds every step (tokens in the batch, seconds the forward pass and sampling took),
and a second fit only the steps that carry prompt tokens; the split decode worker feeds every remote prefill (prompt plus the prefill queue ahead of it,
seconds from the call to the K/V in place). The placement rule (disagg/placement.py) reads the
fits, and `StepTimeBudget` turns the prompt-step fit and an ITL target into the prompt tokens a
step may carry beside its decode rows (the scheduler's cut). Exponentially weighted least squares, so the figures follow a batch that grows or a
machine that gets busier; a prior that never fades keeps the fit defined before the first
measurement and while all measurements have one size (a decode batch of one, say). The prior
is a shape, not figures: 512 tokens cost what ~18 decode steps do, scaled to the steps measured,
so a machine ten times slower than the reference one extrapolates ten times slower too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The priors: the bundled model on this project's 2-core reference machine, quiet
# (docs/benchmarks.md: 18.3 ms a decode step at batch 1, 1,608 prefill tokens/s at 512 tokens).
PRIOR_BASE_S = 0.018
PRIOR_PER_TOKEN_S = 0.0006
PRIOR_SPAN = 512  # the prior is two points, at 1 and at this many tokens
PRIOR_WEIGHT = 0.05  # against ~HALFLIFE × 1.44 of real observations: it only fills gaps
HALFLIFE = 32  # observations
# How fast a fit nobody re-measures loses its say (`LinearCost.fade`): the prompt-step fit's weight
# halves every this many steps that carry no prompt token, so the fresher estimate it falls back
# on (every step's fit) takes over in ~10 of them. Placement is what feeds that fit: with a figure
# from a slow moment it sent every prompt away, nothing was measured here again, and the worker
# stayed remote-only for the rest of the run (docs/benchmarks.md, prefill-heavy run 3).
STALE_HALFLIFE = 32  # steps


@dataclass
class LinearCost:
    """seconds ≈ base + per_token × tokens, fitted to the recent observations."""

    prior_base: float = PRIOR_BASE_S
    prior_per_token: float = PRIOR_PER_TOKEN_S
    halflife: float = HALFLIFE
    count: int = 0  # observations so far
    # decayed w, wx, wy, wxx, wxy, and w·y/prior(x) (how much slower than the prior this runs)
    _sums: list[float] = field(default_factory=lambda: [0.0] * 6)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds < 0:
            return
        d = 0.5 ** (1 / self.halflife)
        x, y = float(tokens), seconds
        ratio = y / (self.prior_base + self.prior_per_token * x)
        self._sums = [s * d + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y, ratio), strict=True)]
        self.count += 1

    def fade(self, halflife: float = STALE_HALFLIFE) -> None:
        """A step without an observation: the measurements so far lose weight against the prior
        (the estimate `fit(prior=...)` falls back on), as a figure no one re-measures should. The
        line they fit stays the same while they outweigh the prior; an observation counts in full."""
        d = 0.5 ** (1 / halflife)
        self._sums = [s * d for s in self._sums]

    def fit(self, prior: tuple[float, float] | None = None) -> tuple[float, float]:
        """(base seconds, seconds per token), both at least 0. `prior` (base, per token) stands
        in for this estimate's own where another one is a better guess (a prefill worker's
        round trip before it is measured: this worker's step plus a hop)."""
        w, sx, sy, sxx, sxy, sratio = self._sums
        half = PRIOR_WEIGHT / 2
        scale = sratio / w if w > 0 else 1.0
        pbase, pper_token = prior or (self.prior_base * scale, self.prior_per_token * scale)
        for x in (1.0, float(PRIOR_SPAN)):
            y = pbase + pper_token * x
            w, sx, sy, sxx, sxy = w + half, sx + half * x, sy + half * y, sxx + half * x * x, sxy + half * x * y
        det = w * sxx - sx * sx
        per_token = max(0.0, (w * sxy - sx * sy) / det)
        base = max(0.0, (sy - per_token * sx) / w)
        return base, per_token

    def predict(self, tokens: int) -> float:
        base, per_token = self.fit()
        return base + per_token * tokens


# Fewest prompt tokens a capped step still carries: progress for a prompt even where the fit says
# that no token fits (a machine slower than the target allows).
MIN_PROMPT_TOKENS = 8
# Share of an ITL target a capped step is planned to take: the fit's error and a token's way out
# (detokenizing, the router's hop, K/V landing on the same core) come on top. With the whole
# target, ITL p90 measured 123 ms against a 100 ms target on the 2-core AVX2 machine.
STEP_AIM = 0.8


# The longest estimated round trip a decode worker pauses for at all (`pause_for_remote`), in ITL
# targets: a chat's prompt on one core (~250 ms for 64 tokens on the 2-core AVX2 machine), not a
# document's.
MAX_PAUSED_PREFILL = 5.0
# Most streams a pause holds up: it trades each one's wait for one prompt's first token, a trade
# that pays for a stream or two at low load, not for a batch. With any batch paused, decode-heavy
# at 1.26 req/s met a 50 ms ITL SLO for 0.71 req/s against 1.04 without pauses (docs/benchmarks.md).
MAX_PAUSED_STREAMS = 2


def pace_slack(target_s: float, streams: list[tuple[int, float]]) -> float:
    """Seconds every stream may still wait for its next token and keep an ITL target of
    `target_s` as a pace: (tokens out so far, seconds since its first token) each; n tokens out
    after the next are n gaps, n × target in all (the benchmarks' per-request ITL, DistServe's
    TPOT). STEP_AIM's margin is kept, as for a step (StepTimeBudget)."""
    return min(n * target_s - elapsed for n, elapsed in streams) - (1 - STEP_AIM) * target_s


def pause_for_remote(target_s: float, streams: list[tuple[int, float, float]], remote: list[tuple[float, float]],
                     step_s: float) -> float:
    """Seconds a split decode worker leaves its CPU idle before its next step, for a prefill
    worker that borrows that CPU (`phasesplit up --pin-cpus`) and is computing a prompt for it:
    a chat's prefill on both cores instead of one, as a colocated engine's would be.
    `streams`: each running stream as (tokens out, seconds since its first token, seconds since
    its last); `remote`: each remote prefill in flight as (seconds its round trip was estimated to
    take, seconds it has run); `step_s`: the next decode step's estimated length.
    Only while every remote prefill fits MAX_PAUSED_PREFILL targets (a long prompt's prefill is not
    worth stopping the streams for), for at most MAX_PAUSED_STREAMS streams, and never so long
    that a stream's gap between two tokens outgrows the target (STEP_AIM of it, with the step that
    ends the gap) or a stream falls behind the target's pace (`pace_slack`). So a long prefill
    gets the CPU in pauses between steps, each gap within the target: pausing it whole (up to two
    targets) took split's ITL p99 from ~100 ms to 143-183 ms in the heavy interference case.
    0: step now."""
    if not streams or len(streams) > MAX_PAUSED_STREAMS or not remote or any(est > MAX_PAUSED_PREFILL * target_s for est, _ in remote):
        return 0.0
    left = max(est - ran for est, ran in remote)
    gap = STEP_AIM * target_s - max(since_last for *_, since_last in streams) - step_s
    return max(0.0, min(left, gap, pace_slack(target_s, [(n, elapsed) for n, elapsed, _ in streams])))


@dataclass(frozen=True)
class StepTimeBudget:
    """A step that carries decode rows must end within `target_s`: the prompt tokens it may carry
    besides them, from the fitted step cost (base + per_token × tokens)."""

    target_s: float
    base_s: float
    per_token_s: float
    min_tokens: int = MIN_PROMPT_TOKENS

    def prompt_tokens(self, decode_rows: int) -> int:
        if self.per_token_s <= 0:
            return 1 << 30  # nothing measured costs per token: no cap to keep
        fit = int((self.target_s - self.base_s) / self.per_token_s + 1e-9) - decode_rows  # 1e-9: 19.999… is 20
        return max(self.min_tokens, fit)


# Share of a prompt-carrying step its fixed cost (the fit's base: the weight stream and the step's
# own overhead) may be before prompt chunks stop growing. Past that a bigger chunk buys under 5 %
# more prompt tokens per second, and costs every first token and every stream that shares the
# step its whole length: on one AVX2 core a 512-token chunk takes ~2.7 s, and a chat whose
# prompt joined that step waited all of it (docs/benchmarks.md, "Interference").
CHUNK_OVERHEAD = 0.05
MIN_CHUNK_TOKENS = 32  # a floor against a fit whose base is an artefact of few step sizes


def efficient_chunk(base_s: float, per_token_s: float, overhead: float) -> int | None:
    """The fewest prompt tokens a step may carry with its fixed cost `base_s` at most `overhead`
    of the step; None where there is nothing to weigh (no per-token cost, or no overhead given).
    A fit with no fixed cost gets the floor, as one with next to none does: a run of floor-sized
    chunks can fit a base of 0 on a noisy machine, and returning None there lifted the cap in the
    middle of a prompt (a 419-token step after a 32-token one, in test_chunk_cap under CI)."""
    if overhead <= 0 or per_token_s <= 0:
        return None
    return max(MIN_CHUNK_TOKENS, math.ceil(max(0.0, base_s) * (1 - overhead) / (overhead * per_token_s) - 1e-9))
