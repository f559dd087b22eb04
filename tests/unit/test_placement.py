"""Prefill placement (runtime/disagg/placement.py) on step costs recorded on this machine, and the
rolling fit that turns step times into those figures (runtime/engine/step_costs.py)."""

from __future__ import annotations

import dataclasses

import pytest

from phasesplit.runtime.disagg import placement as pl
from phasesplit.runtime.engine.step_costs import MIN_PROMPT_TOKENS, LinearCost, StepTimeBudget

# Engine steps recorded with the bundled model (SmolLM2-135M, float32, 2 threads), as
# (tokens in the step, seconds):
# - QUIET: docs/benchmarks.md, load 0.7-1.4: a decode step at batch 1 (18.3 ms) and at batch 32
#   (49.4 ms), a 512-token prompt plus its token at 1,608 tokens/s.
# - LOADED: 2026-12-02 00:25 UTC, load average 4.1-6.2 (a CoreDNS build and two other sessions on
#   the 2 cores), LLMEngine.step timed by an EngineObserver: medians of 3 prefills alone of 16,
#   64, 256 and 512 tokens, of 11 decode steps at batch 1, 4, 8 and 16.
QUIET = [(1, 0.0183), (32, 0.0494), (512, 0.318)]
LOADED = [(16, 0.414), (64, 1.019), (256, 2.284), (512, 6.551), (1, 0.226), (4, 0.387), (8, 0.657), (16, 0.792)]


def fitted(steps: list[tuple[int, float]], rounds: int = 10) -> LinearCost:
    cost = LinearCost()
    for _ in range(rounds):
        for tokens, seconds in steps:
            cost.observe(tokens, seconds)
    return cost


def figures(local: LinearCost, remote: LinearCost, prompt: int, *, running: int = 0, local_queued: int = 0,
            remote_queued: int = 0, itl: float | None = 0.1, budget: int = 512) -> pl.Figures:
    base, per_token = local.fit()
    rbase, rper_token = remote.fit()
    return pl.Figures(prompt_tokens=prompt, running=running, local_queued_tokens=local_queued, step_budget=budget,
                      local_base_s=base, local_per_token_s=per_token, remote_base_s=rbase,
                      remote_per_token_s=rper_token, remote_queued_tokens=remote_queued, itl_target_s=itl)


def remote_like(local: LinearCost, hop_s: float) -> LinearCost:
    """A prefill worker on the same hardware, seen through a round trip that adds `hop_s`."""
    base, per_token = local.fit()
    return fitted([(t, base + hop_s + per_token * t) for t in (16, 128, 512, 2048)])


def test_fit_follows_recorded_steps():
    cost = fitted(QUIET)
    base, per_token = cost.fit()
    # A line through a curve (attention is not linear): within 8 ms or a fifth of each step.
    for tokens, seconds in QUIET:
        assert cost.predict(tokens) == pytest.approx(seconds, rel=0.2, abs=0.008)
    assert 0.01 < base < 0.03 and 0.0004 < per_token < 0.0008
    loaded = fitted(LOADED)
    assert loaded.predict(512) > 10 * cost.predict(512)  # the busy machine's figures take over


def test_fit_without_measurements_is_the_prior_and_one_size_stays_defined():
    prior = LinearCost()
    assert prior.fit() == pytest.approx((0.018, 0.0006))
    only_decode = fitted([(1, 0.05)])  # a decode batch of one, nothing else yet
    base, per_token = only_decode.fit()
    assert only_decode.predict(1) == pytest.approx(0.05, rel=0.1)
    assert per_token > 0 and base > 0
    assert prior.fit(prior=(0.3, 0.01)) == pytest.approx((0.3, 0.01))  # another estimate's, when given
    # Only small steps measured (decode batches of 1-16 on the loaded machine): the long prompt's
    # cost is extrapolated from the prior's shape scaled to them, not from the quiet prior's figures.
    decode_only = fitted([(t, s) for t, s in LOADED[4:]])
    assert decode_only.predict(512) == pytest.approx(6.551, rel=0.4)  # a guess: 8.7 s for 6.6 measured
    busier = fitted(QUIET, rounds=3)
    for _ in range(200):  # the machine gets 3x slower: old steps fade
        busier.observe(512, 3 * 0.318)
    assert busier.predict(512) == pytest.approx(3 * 0.318, rel=0.05)


def test_quiet_machine_short_prompt_here_long_prompt_there():
    local = fitted(QUIET)
    remote = remote_like(local, hop_s=0.01)
    chat = pl.place(figures(local, remote, 40), have_remote=True)
    assert (chat.where, chat.reason) == (pl.LOCAL, pl.SHORT_PROMPT)
    assert chat.local_s < chat.remote_s
    # A 300-token prompt would be sooner here too, but its step would take ~0.2 s: every stream
    # in (or joining) the batch would wait that long for its next token.
    doc = pl.place(figures(local, remote, 300), have_remote=True)
    assert (doc.where, doc.reason) == (pl.REMOTE, pl.ITL_BUDGET)
    assert doc.local_s < doc.remote_s
    # Without an ITL target it is prefilled where it is sooner: here, at idle.
    assert pl.place(figures(local, remote, 300, itl=None), have_remote=True).where == pl.LOCAL
    # A ~1,800-token document takes four steps here, one call there: there.
    assert pl.place(figures(local, remote, 1800, itl=None), have_remote=True).reason == pl.REMOTE_FASTER
    # Next to a few streams a chat is still sooner here; next to 32 the step they share makes it
    # later than a round trip (and the streams slower): there.
    assert pl.place(figures(local, remote, 40, running=4), have_remote=True).where == pl.LOCAL
    assert pl.place(figures(local, remote, 40, running=32), have_remote=True).reason == pl.REMOTE_FASTER


def test_queued_prefill_pool_keeps_prompts_here():
    local = fitted(QUIET)
    remote = remote_like(local, hop_s=0.01)
    # 128 tokens beside 24 streams: slower here than on an idle prefill worker...
    idle = pl.place(figures(local, remote, 128, running=24, itl=None), have_remote=True)
    assert (idle.where, idle.reason) == (pl.REMOTE, pl.REMOTE_FASTER)
    # ...but not behind 4,000 queued tokens there.
    queued = pl.place(figures(local, remote, 128, running=24, itl=None, remote_queued=4000), have_remote=True)
    assert (queued.where, queued.reason) == (pl.LOCAL, pl.PREFILL_QUEUED)
    # The ITL target still wins over the queue when the step would outgrow it.
    tight = pl.place(figures(local, remote, 128, running=24, itl=0.05, remote_queued=4000), have_remote=True)
    assert (tight.where, tight.reason) == (pl.REMOTE, pl.ITL_BUDGET)


def test_busy_decode_batch_sends_long_prompts_away():
    local = fitted(QUIET)
    remote = remote_like(local, hop_s=0.01)
    d = pl.place(figures(local, remote, 2000, running=60, itl=None), have_remote=True)
    assert (d.where, d.reason) == (pl.REMOTE, pl.REMOTE_FASTER)
    # The local queue counts too: a short prompt behind 3,000 local prompt tokens goes remote.
    q = pl.place(figures(local, remote, 40, local_queued=3000, itl=None), have_remote=True)
    assert (q.where, q.reason) == (pl.REMOTE, pl.REMOTE_FASTER)


def test_loaded_machine_cannot_keep_the_itl_target_here():
    """On the loaded figures one step takes longer than 100 ms on its own, so a local prefill
    always breaks the target; without one, short prompts stay here and long ones do not."""
    local = fitted(LOADED)
    remote = remote_like(local, hop_s=0.05)
    assert pl.place(figures(local, remote, 16), have_remote=True).reason == pl.ITL_BUDGET
    assert pl.place(figures(local, remote, 16, itl=None), have_remote=True).where == pl.LOCAL
    busy = pl.place(figures(local, remote, 1800, running=16, itl=None), have_remote=True)
    assert (busy.where, busy.reason) == (pl.REMOTE, pl.REMOTE_FASTER)


def test_overrides():
    local = fitted(QUIET)
    remote = remote_like(local, hop_s=0.01)
    f = figures(local, remote, 40)
    assert pl.place(f, have_remote=False) == pl.Decision(pl.LOCAL, pl.NO_PREFILL_WORKER)
    assert pl.place(f, have_remote=True, threshold=40) == pl.Decision(pl.LOCAL, pl.OVERRIDE)
    assert pl.place(f, have_remote=True, mode=pl.STATIC) == pl.Decision(pl.REMOTE, pl.OVERRIDE)
    # The threshold beats the figures both ways: a long prompt under it stays here.
    assert pl.place(figures(local, remote, 1800), have_remote=True, threshold=2000).where == pl.LOCAL
    for d in (pl.place(figures(local, remote, n, running=r, remote_queued=q), have_remote=True)
              for n in (1, 40, 500, 1800) for r in (0, 8, 64) for q in (0, 5000)):
        assert (d.where, d.reason) in pl.OUTCOMES


def capped(local: LinearCost, remote: LinearCost, prompt: int, **kw) -> pl.Figures:
    """figures() with local chunks cut to a 100 ms target, as the decode worker builds them."""
    f = figures(local, remote, prompt, **kw)
    budget = StepTimeBudget(0.1, f.local_base_s, f.local_per_token_s)
    return dataclasses.replace(f, step_prompt_tokens=budget.prompt_tokens(max(1, f.running)))


def test_chunks_cut_to_the_itl_target_let_a_queued_pool_share_the_decode_core():
    """With local chunks cut to the ITL target (the engine's StepTimeBudget), a long prompt no
    longer breaks the target here: it goes where it is sooner, which is here once the prefill
    pool is queued, and there while it is not."""
    local = fitted(QUIET)
    remote = remote_like(local, hop_s=0.01)
    uncut = pl.place(figures(local, remote, 300, running=2, remote_queued=4000), have_remote=True)
    assert (uncut.where, uncut.reason) == (pl.REMOTE, pl.ITL_BUDGET)  # one 300-token step: ~0.2 s
    f = capped(local, remote, 300, running=2, remote_queued=4000)
    assert 100 < f.step_prompt_tokens < 300
    step = f.local_base_s + f.local_per_token_s * (f.running + f.step_prompt_tokens)
    assert step <= 0.1
    cut = pl.place(f, have_remote=True)
    assert (cut.where, cut.reason) == (pl.LOCAL, pl.PREFILL_QUEUED)
    # More steps here than one uncut chunk would take, and still sooner than behind the queue.
    assert pl.local_seconds(f) > pl.local_seconds(dataclasses.replace(f, step_prompt_tokens=None))
    idle_pool = pl.place(capped(local, remote, 300, running=2), have_remote=True)
    assert (idle_pool.where, idle_pool.reason) == (pl.REMOTE, pl.REMOTE_FASTER)
    # On the loaded figures no chunk keeps 100 ms: the smallest still breaks it, so: there.
    loaded = fitted(LOADED)
    lf = capped(loaded, remote_like(loaded, hop_s=0.05), 300, running=2, remote_queued=4000)
    assert lf.step_prompt_tokens == MIN_PROMPT_TOKENS
    assert pl.place(lf, have_remote=True).reason == pl.ITL_BUDGET


def test_a_prompt_step_figure_from_a_slow_moment_fades_once_decode_steps_are_quick_again():
    """Placement feeds the prompt-step fit: once it keeps prompts away, nothing is measured here.
    A figure from a slow moment must not keep them away for good: while no prompt step runs, the
    fit fades (the engine calls `fade` each step without one) towards every step's fit, which the
    decode steps keep fresh; one prompt step measured here counts in full again."""
    steps, prompt_steps = LinearCost(), LinearCost()  # as LLMEngine keeps them

    def place(chat: int = 40) -> pl.Decision:
        base, per_token = prompt_steps.fit(prior=steps.fit())
        remote = remote_like(fitted(QUIET), hop_s=0.01)
        f = dataclasses.replace(figures(fitted(QUIET), remote, chat, running=2), local_base_s=base,
                                local_per_token_s=per_token)
        return pl.place(f, have_remote=True)

    for _ in range(3):  # a burst on the loaded machine: prompt steps of seconds
        for tokens, seconds in LOADED[:4]:
            steps.observe(tokens, seconds)
            prompt_steps.observe(tokens, seconds)
    assert place().where == pl.REMOTE
    stale = LinearCost(_sums=list(prompt_steps._sums))  # the same fit, never faded
    for _ in range(600):  # then quiet decode steps at batch 2, ~20 ms: 600 steps is ~12 s
        steps.observe(2, 0.02)
        prompt_steps.fade()
    assert place() == place()  # pure
    assert place().where == pl.LOCAL
    prompt_steps, kept = stale, prompt_steps
    assert place().where == pl.REMOTE  # without fading: remote for good
    prompt_steps = kept
    prompt_steps.observe(42, 1.0)  # a chat's step here, measured slow again: that decides at once
    assert place().where == pl.REMOTE


def test_a_decode_worker_pauses_for_a_short_remote_prefill_only_within_its_streams_pace():
    """LLMEngine.remote_pause's rule (step_costs.pause_for_remote): leave the CPU to a chat's
    remote prefill while every stream is ahead of the ITL target's pace, for what is left of the
    prefill's estimate, never so long that a gap between two tokens outgrows the target, nor
    longer than what the slowest stream saved."""
    from phasesplit.runtime.engine.step_costs import (
        MAX_PAUSED_PREFILL,
        MAX_PAUSED_STREAMS,
        STEP_AIM,
        pace_slack,
        pause_for_remote,
    )

    target, step = 0.1, 0.02
    gap = STEP_AIM * target - step  # the longest pause right after a step: 60 ms
    ahead = (50, 0.6, 0.0)  # 50 tokens out 0.6 s after its first, the last just now: 4.4 s ahead of pace
    on_pace = (10, 0.99, 0.0)  # 10 tokens in 0.99 s: 10 ms of its next gap left, under the 20 ms margin
    assert pace_slack(target, [ahead[:2]]) == pytest.approx(50 * target - 0.6 - (1 - STEP_AIM) * target)
    assert pace_slack(target, [ahead[:2], on_pace[:2]]) < 0
    # A 50 ms prefill just called: wait all of it; 30 ms into it: the 20 ms left.
    assert pause_for_remote(target, [ahead], [(0.05, 0.0)], step) == pytest.approx(0.05)
    assert pause_for_remote(target, [ahead], [(0.05, 0.03)], step) == pytest.approx(0.02)
    # A longer one gets the CPU between steps: each pause ends in time for the step that ends the
    # gap within the target, however far ahead the streams are; a gap already that long: step.
    assert pause_for_remote(target, [ahead], [(0.45, 0.0)], step) == pytest.approx(gap)
    assert pause_for_remote(target, [(50, 0.6, 0.04)], [(0.45, 0.1)], step) == pytest.approx(gap - 0.04)
    assert pause_for_remote(target, [(50, 0.6, gap)], [(0.45, 0.2)], step) == pytest.approx(0)
    assert pause_for_remote(target, [ahead, (50, 0.6, 0.05)], [(0.45, 0.0)], step) == pytest.approx(gap - 0.05)
    # A slower step leaves less of the gap to pause in.
    assert pause_for_remote(target, [ahead], [(0.45, 0.0)], 0.05) == pytest.approx(STEP_AIM * target - 0.05)
    # A document's (estimated past MAX_PAUSED_PREFILL targets): the streams go on, as do they
    # beside a chat's when another remote prefill in flight is a document's.
    doc = (MAX_PAUSED_PREFILL * target + 0.01, 0.0)
    assert pause_for_remote(target, [ahead], [doc], step) == 0
    assert pause_for_remote(target, [ahead], [(0.05, 0.0), doc], step) == 0
    # A stream on pace (or behind) is never held up; a young one only as far as it saved.
    assert pause_for_remote(target, [ahead, on_pace], [(0.05, 0.0)], step) == 0
    young = (1, 0.03, 0.03)  # its first token 30 ms ago: 100 ms - 30 ms - the 20 ms margin = 50 ms
    assert pause_for_remote(target, [young], [(0.2, 0.0)], 0.0) == pytest.approx(0.05)
    # A batch is not held up for one prompt: at most MAX_PAUSED_STREAMS streams are.
    assert pause_for_remote(target, [ahead] * MAX_PAUSED_STREAMS, [(0.05, 0.0)], step) == pytest.approx(0.05)
    assert pause_for_remote(target, [ahead] * (MAX_PAUSED_STREAMS + 1), [(0.05, 0.0)], step) == 0
    # Nothing to pause for, or nobody to pause: step.
    assert pause_for_remote(target, [ahead], [], step) == 0
    assert pause_for_remote(target, [], [(0.05, 0.0)], step) == 0
