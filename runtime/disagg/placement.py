"""Where a decode worker has a prompt prefilled: here, or on a prefill worker. Pure.

Adaptive disaggregation (docs/architecture.md, "Prefill placement"): each prompt goes where its
first token comes soonest, unless prefilling it here would push the decode batch's steps past
the ITL target. The inputs are the runtime's own measured figures (runtime/engine/step_costs.py):
this worker's cost of a step that carries prompt tokens (base + per token, at its running
batch), the round-trip cost of a remote prefill (call, prefill, K/V in place) per prompt token,
and the prefill worker's queue as the router last saw it. The fixed --local-prefill-threshold stays as an override.

A local prefill beside running streams goes in chunks cut to the ITL target (the engine's
StepTimeBudget, runtime/engine/step_costs.py): it keeps the target by construction unless even
the smallest chunk outgrows it, and it takes more steps, which `local_seconds` counts. So when
the prefill pool is queued, the decode worker's idle share of its core prefills too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOCAL, REMOTE = "local", "remote"

# Why (the `reason` label of phasesplit_prefill_placement_total).
SHORT_PROMPT = "short_prompt"  # here is sooner even with the prefill pool idle
PREFILL_QUEUED = "prefill_queued"  # here is sooner because of the prefill pool's queue
ITL_BUDGET = "itl_budget"  # here would be sooner, but would break the decode batch's ITL target
REMOTE_FASTER = "remote_faster"  # the prefill worker is sooner
OVERRIDE = "override"  # the fixed threshold (or static placement) decided
NO_PREFILL_WORKER = "no_prefill_worker"  # none to call: here
REMOTE_FAILED = "remote_failed"  # the failure policy's fallback to here
REASONS = (SHORT_PROMPT, PREFILL_QUEUED, ITL_BUDGET, REMOTE_FASTER, OVERRIDE, NO_PREFILL_WORKER, REMOTE_FAILED)
OUTCOMES = ((LOCAL, SHORT_PROMPT), (LOCAL, PREFILL_QUEUED), (LOCAL, OVERRIDE), (LOCAL, NO_PREFILL_WORKER),
            (LOCAL, REMOTE_FAILED), (REMOTE, ITL_BUDGET), (REMOTE, REMOTE_FASTER), (REMOTE, OVERRIDE))

ADAPTIVE, STATIC = "adaptive", "static"
MODES = (ADAPTIVE, STATIC)


@dataclass(frozen=True)
class Figures:
    """What the decode worker knows when it places one prompt (seconds, tokens)."""

    prompt_tokens: int  # the uncached part: what a prefill would compute
    running: int  # the decode batch: requests generating here
    local_queued_tokens: int  # prompt tokens already waiting to be prefilled here
    step_budget: int  # tokens one step may carry (--max-num-batched-tokens)
    local_base_s: float  # this worker's step: base + per_token × tokens in the step
    local_per_token_s: float
    remote_base_s: float  # a remote prefill's round trip: base + per_token × (queue + prompt)
    remote_per_token_s: float
    remote_queued_tokens: int  # prompt tokens ahead of it on the prefill worker
    itl_target_s: float | None  # None: no ITL target to keep
    # Prompt tokens one step here carries beside the decode batch under the ITL target (the
    # engine's StepTimeBudget); None: as many as step_budget leaves.
    step_prompt_tokens: int | None = None


@dataclass(frozen=True)
class Decision:
    where: str
    reason: str
    local_s: float | None = None  # the estimates it compared, when it compared any
    remote_s: float | None = None


def prompt_per_step(f: Figures) -> int:
    """Prompt tokens a step here carries beside the decode batch."""
    per_step = max(1, f.step_budget - f.running)
    return per_step if f.step_prompt_tokens is None else max(1, min(per_step, f.step_prompt_tokens))


def local_seconds(f: Figures) -> float:
    """Time to the first token if prefilled here: the queue here and the prompt, in chunks
    that share each step with the decode batch."""
    tokens = f.local_queued_tokens + f.prompt_tokens
    per_step = prompt_per_step(f)
    steps = math.ceil(tokens / per_step)
    return steps * (f.local_base_s + f.local_per_token_s * f.running) + f.local_per_token_s * tokens


def remote_seconds(f: Figures, queued_tokens: int) -> float:
    return f.remote_base_s + f.remote_per_token_s * (queued_tokens + f.prompt_tokens)


def breaks_itl(f: Figures) -> bool:
    """Would a step carrying a chunk of this prompt take longer than the ITL target? Checked at
    an idle batch too: a stream that arrives meanwhile joins a batch whose steps carry the
    chunks. With chunks cut to the target (step_prompt_tokens) only the smallest chunk can
    outgrow it, on a machine slower than the target allows."""
    if f.itl_target_s is None:
        return False
    chunk = min(f.prompt_tokens, prompt_per_step(f))
    step = f.local_base_s + f.local_per_token_s * (f.running + chunk)
    return step > f.itl_target_s


def place(f: Figures, *, have_remote: bool, threshold: int = 0, mode: str = ADAPTIVE) -> Decision:
    """Local or remote, and why. `threshold`: prompts of at most this many uncached tokens are
    prefilled here whatever the figures say; `mode` static: every other prompt goes remote."""
    if not have_remote:
        return Decision(LOCAL, NO_PREFILL_WORKER)
    if f.prompt_tokens <= threshold:
        return Decision(LOCAL, OVERRIDE)
    if mode == STATIC:
        return Decision(REMOTE, OVERRIDE)
    local = local_seconds(f)
    remote = remote_seconds(f, f.remote_queued_tokens)
    if local > remote:
        return Decision(REMOTE, REMOTE_FASTER, local, remote)
    if breaks_itl(f):
        return Decision(REMOTE, ITL_BUDGET, local, remote)
    reason = SHORT_PROMPT if local <= remote_seconds(f, 0) else PREFILL_QUEUED
    return Decision(LOCAL, reason, local, remote)
