"""Measured replica start-up (operator/startup.py) and the planner reacting with it."""

from __future__ import annotations

from phasesplit.operator.metrics.autoscale import reaction_startup
from phasesplit.operator.planner import Planner, PlannerConfig
from phasesplit.operator.planner.planner import PhaseLimits
from phasesplit.operator.startup import WINDOW, StartupTimes, pod_startup
from tests.unit.test_planner import _idle, frozen_model


def pod(created: str = "2026-12-01T10:00:00Z", ready_at: str | None = "2026-12-01T10:00:07Z",
        restarts: int = 0, ready: str = "True") -> dict:
    conditions = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": created}]
    if ready_at is not None:
        conditions.append({"type": "Ready", "status": ready, "lastTransitionTime": ready_at})
    return {"metadata": {"creationTimestamp": created},
            "status": {"conditions": conditions, "containerStatuses": [{"restartCount": restarts}]}}


def test_pod_startup_is_creation_to_first_ready():
    assert pod_startup(pod()) == 7.0
    assert pod_startup(pod(ready_at=None)) is None  # not ready yet
    assert pod_startup(pod(ready="False")) is None
    assert pod_startup(pod(restarts=1)) is None  # Ready after a restart is not a start-up
    assert pod_startup({"metadata": {}, "status": {}}) is None


def test_rolling_median_of_the_last_few_counting_each_pod_once():
    times = StartupTimes()
    for i, seconds in enumerate([30, 4, 5, 6, 5, 7]):
        assert times.observe("decode", f"uid-{i}", pod(ready_at=f"2026-12-01T10:00:{seconds:02d}Z"))
    assert not times.observe("decode", "uid-1", pod(ready_at="2026-12-01T10:00:59Z"))  # counted already
    assert not times.observe("prefill", "uid-x", pod(ready_at=None))  # not ready: later
    assert times.median("decode") == 5.0  # the first pod's 30 s left the window of the last WINDOW
    assert len(times.phases["decode"]) == WINDOW
    assert times.medians() == {"decode": 5.0}
    assert times.observe("prefill", "uid-x", pod(ready_at="2026-12-01T10:00:03Z"))
    assert reaction_startup(times.medians()) == 5.0  # the slower phase


def test_a_longer_measured_startup_changes_the_planners_decision():
    """At zero with requests held and arriving: the pair wakes sized for what will have queued
    by the time it is up, which a longer start-up makes more."""
    def woken(startup_s: float) -> dict[str, int]:
        cfg = PlannerConfig(interval_s=15.0, idle_after_s=120.0, prefill=PhaseLimits(0, 16),
                            decode=PhaseLimits(0, 16))
        planner = Planner(cfg, frozen_model())
        planner.use_startup(startup_s)
        assert planner.config.startup_s == startup_s
        assert planner.bursts.reaction_s == startup_s + 15.0
        snap = _idle(15, held_requests=10.0, rate=2.0, isl=2000.0, osl=100.0)
        return planner.plan(snap, {"prefill": 0, "decode": 0}, 15).desired

    fast, slow = woken(5.0), woken(120.0)
    assert slow["prefill"] > fast["prefill"], (fast, slow)
