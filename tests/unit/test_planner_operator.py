"""The operator's side of the planner: spec → knobs, EndpointSlices → scrape targets, status."""

from __future__ import annotations

from phasesplit.operator import api
from phasesplit.operator.metrics.autoscale import endpoint_targets, planner_config, status_patch
from phasesplit.operator.planner import MetricsSnapshot, Planner


def spec(**autoscaling) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({
        "model": {"name": "m", "builtin": "smollm2"},
        "slo": {"ttft": "800ms", "itl": "40ms", "percentile": 99},
        "prefill": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6},
        "decode": {"replicas": 1, "maxReplicas": 3},
        "autoscaling": {"interval": "10s", "ratio": {"min": 0.5, "max": 3},
                        "behavior": {"scaleUp": {"policies": [{"type": "Pods", "value": 1, "periodSeconds": 20}]},
                                     "scaleDown": {"stabilizationWindowSeconds": 60}}, **autoscaling},
    })


def test_spec_maps_onto_planner_knobs():
    cfg = planner_config(spec())
    assert (cfg.ttft_s, cfg.itl_s, cfg.percentile, cfg.interval_s) == (0.8, 0.04, 0.99, 10.0)
    assert (cfg.prefill.min_replicas, cfg.prefill.max_replicas) == (1, 6)
    assert (cfg.decode.min_replicas, cfg.decode.max_replicas) == (1, 3)
    assert (cfg.min_pd_ratio, cfg.max_pd_ratio) == (0.5, 3)
    up, down = cfg.behavior.scale_up, cfg.behavior.scale_down
    assert up.policies[0].type == "Pods" and up.policies[0].value == 1 and up.policies[0].period_seconds == 20
    assert down.stabilization_window_seconds == 60 and down.policies == []


def test_no_scale_down_policy_means_unlimited():
    # The spec documents an empty policy list as "no rate limit" in Planner mode.
    cfg = planner_config(spec())
    planner = Planner(cfg)
    now = 0.0
    for now in (0.0, 70.0):  # past the 60 s window and the restart guard
        d = planner.plan(MetricsSnapshot(timestamp=now, window_s=10, request_rate=0.0, prompt_token_rate=0.0,
                                         generation_token_rate=0.0), {"prefill": 6, "decode": 3}, now)
    assert d.prefill.desired == 1 and d.decode.desired == 1


def test_endpoint_slices_become_metrics_urls_of_ready_endpoints():
    slices = [
        {"ports": [{"name": "http", "port": 8000}, {"name": "kv", "port": 9000}],
         "endpoints": [
             {"addresses": ["10.0.0.5"], "conditions": {"ready": True}, "targetRef": {"name": "svc-decode-abc"}},
             {"addresses": ["10.0.0.6"], "conditions": {"ready": False}, "targetRef": {"name": "svc-decode-def"}},
         ]},
        {"ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["fd00::7"], "conditions": {"ready": True}}]},
        {"ports": [{"name": "other", "port": 1}], "endpoints": [{"addresses": ["10.0.0.9"]}]},
    ]
    assert endpoint_targets(slices) == {"svc-decode-abc": "http://10.0.0.5:8000/metrics",
                                        "fd00::7": "http://[fd00::7]:8000/metrics"}


def test_status_patch_records_decision_observation_and_condition():
    planner = Planner(planner_config(spec()))
    snap = MetricsSnapshot(timestamp=100, window_s=10, request_rate=3.0, prompt_token_rate=3000.0,
                           generation_token_rate=300.0, ttft_p=0.2, itl_p=0.02, slo_attainment=0.97)
    d = planner.plan(snap, {"prefill": 6, "decode": 3}, 100)
    patch = status_patch(d, snap, 100, generation=4)
    assert patch["mode"] == "Planner"
    assert patch["observed"] == {"ttftSeconds": 0.2, "itlSeconds": 0.02, "requestRate": 3.0, "attainment": 0.97}
    assert patch["lastDecision"]["generation"] == 4 and patch["lastDecision"]["reason"]
    api.AutoscalingStatus.model_validate(patch)  # what the CRD schema accepts
    # Stale metrics: the decision holds, the condition turns False, the last observation stays.
    stale = planner.plan(None, {"prefill": 6, "decode": 3}, 200)
    later = status_patch(stale, None, 200, generation=4, previous=patch)
    cond = later["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == ("MetricsAvailable", "False", "MetricsStale")
    assert later["observed"] == patch["observed"] and later["lastDecision"] == patch["lastDecision"]


def test_unreachable_endpoints_are_asked_again_only_after_a_backoff():
    """Endpoints that all failed cost nothing on the next intervals (1, 2, 4 ... intervals apart),
    until the endpoints change."""
    import asyncio
    import socket

    from phasesplit.operator.metrics.autoscale import ServiceAutoscaler

    with socket.socket() as s:  # a port nothing listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    scaler = ServiceAutoscaler(spec())  # interval 10 s
    targets = {"pod-a": f"http://127.0.0.1:{closed}/metrics"}
    current = {"prefill": 2, "decode": 1}

    def asked(t: float, tg=targets) -> bool:
        return bool(asyncio.run(scaler.step(current, tg, t)).errors)
    assert [asked(t) for t in (0, 10, 20, 30, 40, 50, 60, 70)] == [True, False, True, False, False, True,
                                                                   False, False]
    # New endpoints: asked at once.
    assert asked(80, {"pod-b": f"http://127.0.0.1:{closed}/metrics"})
    # No ready endpoint: nothing to ask, and the decision holds.
    result = asyncio.run(scaler.step(current, {}, 90))
    assert result.errors == [] and result.decision.desired == current
