"""The operator's own metrics (phasesplit.operator.telemetry): what the alert rules and the
dashboard join the runtime's series with, read back from the registry's exposition."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phasesplit.operator import api
from phasesplit.operator.planner.planner import Decision, PhaseDecision
from phasesplit.operator.planner.snapshot import MetricsSnapshot
from phasesplit.operator.telemetry import OperatorTelemetry, slo_bucket
from phasesplit.runtime import metric_names as names
from phasesplit.runtime.metric_names import ITL_BUCKETS, TTFT_BUCKETS


def samples(t: OperatorTelemetry) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(t.registry).decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def find(t: OperatorTelemetry, name: str, **labels: str) -> list[float]:
    want = set(labels.items())
    return [v for (n, ls), v in samples(t).items() if n == name and want <= ls]


def spec(**slo) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({
        "model": {"builtin": "smollm2", "name": "chat"}, "slo": slo,
        "prefill": {"replicas": 1, "maxReplicas": 3}, "decode": {"replicas": 2, "maxReplicas": 5}})


@pytest.mark.parametrize("target, buckets, le", [
    (0.5, TTFT_BUCKETS, "0.5"),      # a bound itself
    (0.3, TTFT_BUCKETS, "0.25"),     # the largest bound below: conservative
    (0.0005, TTFT_BUCKETS, "0.001"),  # below every bound: the first
    (1.0, TTFT_BUCKETS, "1.0"),      # formatted as the runtime's exposition writes it
    (0.05, ITL_BUCKETS, "0.05"),
])
def test_slo_bucket_names_the_runtime_le_label(target, buckets, le):
    assert slo_bucket(target, buckets) == le


def test_service_series_follow_the_spec():
    t = OperatorTelemetry()
    t.observe_service("prod", "svc", spec(ttft="300ms", itl="50ms", percentile=95))
    base = {"namespace": "prod", "inferenceservice": "svc", "model": "chat"}
    assert find(t, names.OPERATOR_SLO_TARGET, **base, slo="ttft") == [0.3]
    assert find(t, names.OPERATOR_SLO_BUCKET, **base, slo="ttft", le="0.25") == [1]
    assert find(t, names.OPERATOR_SLO_BUCKET, **base, slo="itl", le="0.05") == [1]
    assert find(t, names.OPERATOR_SLO_ERROR_BUDGET, **base) == [pytest.approx(0.05)]
    assert find(t, names.OPERATOR_MAX_REPLICAS, **base, phase="decode") == [5]
    assert find(t, names.OPERATOR_DEPLOYMENT_INFO, **base, phase="prefill", deployment="svc-prefill") == [1]
    # A new target moves the bucket: the old `le` series goes, or the rules would see two.
    t.observe_service("prod", "svc", spec(ttft="2s"))
    assert len(find(t, names.OPERATOR_SLO_BUCKET, **base, slo="ttft")) == 1
    assert find(t, names.OPERATOR_SLO_BUCKET, **base, slo="ttft", le="2.5") == []
    assert find(t, names.OPERATOR_SLO_BUCKET, **base, slo="ttft", le="1.0") == [1]
    t.forget("prod", "svc")
    assert not [k for k in samples(t) if ("inferenceservice", "svc") in k[1]]


def test_decisions_count_by_phase_and_direction():
    t = OperatorTelemetry()
    snap = MetricsSnapshot(timestamp=0, window_s=30, ttft_p=0.8, itl_p=0.02)
    up = Decision(PhaseDecision(1, 2, 2, "TTFT"), PhaseDecision(2, 2, 2, ""), stale=False,
                  predicted_ttft_s=0.4, predicted_itl_s=0.03)
    t.decided("prod", "svc", "chat", up, snap)
    base = {"namespace": "prod", "inferenceservice": "svc", "model": "chat"}
    assert find(t, names.OPERATOR_PLANNER_DECISIONS, **base, phase="prefill", direction="up") == [1]
    assert find(t, names.OPERATOR_PLANNER_DECISIONS, **base, phase="decode", direction="hold") == [1]
    assert find(t, names.OPERATOR_PLANNER_DESIRED, **base, phase="prefill") == [2]
    assert find(t, names.OPERATOR_PLANNER_PREDICTED, **base, slo="ttft") == [0.4]
    assert find(t, names.OPERATOR_PLANNER_OBSERVED, **base, slo="ttft") == [0.8]
    assert find(t, names.OPERATOR_PLANNER_STALE, **base) == [0]
    # A stale step holds: no observation, no prediction, and the counters keep counting.
    held = Decision(PhaseDecision(2, 2, 2, "stale"), PhaseDecision(2, 1, 2, "stale"), stale=True)
    t.decided("prod", "svc", "chat", held, None)
    assert find(t, names.OPERATOR_PLANNER_STALE, **base) == [1]
    assert find(t, names.OPERATOR_PLANNER_OBSERVED, **base) == []
    assert find(t, names.OPERATOR_PLANNER_DECISIONS, **base, phase="prefill", direction="up") == [1]
    assert find(t, names.OPERATOR_PLANNER_DECISIONS, **base, phase="prefill", direction="hold") == [1]


def test_reconciles_are_counted_timed_and_errors_propagate():
    t = OperatorTelemetry()
    with t.reconciling("prod", "svc"):
        pass
    with pytest.raises(RuntimeError), t.reconciling("prod", "svc"):
        raise RuntimeError("apply failed")
    svc = {"namespace": "prod", "inferenceservice": "svc"}
    assert find(t, names.OPERATOR_RECONCILES, **svc) == [2]
    assert find(t, names.OPERATOR_RECONCILE_ERRORS, **svc) == [1]
    assert find(t, names.OPERATOR_RECONCILE_SECONDS + "_count", **svc) == [2]
