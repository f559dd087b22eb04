"""The InferenceService API models: defaults, effective values and the validation rules.

INVALID_SPECS is shared with tests/cluster/test_operator.py, which sends the same specs
to the real API server: pydantic and the CRD's schema/CEL rules must reject the same things.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from phasesplit.operator import api

# The issue's minimal object, verbatim.
MINIMAL: dict[str, Any] = {
    "model": {"name": "smollm2-135m", "builtin": "smollm2"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 2},
}


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge patch onto a copy of base; a None value deletes the key."""
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merged(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# (case id, patch onto MINIMAL, the field the API server's message must name)
INVALID_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("two-model-sources", {"model": {"hostPath": {"directory": "/models"}}}, "spec.model"),
    ("no-model-source", {"model": {"builtin": None}}, "spec.model"),
    ("min-above-replicas", {"prefill": {"replicas": 1, "minReplicas": 2}}, "spec.prefill.minReplicas"),
    ("replicas-above-max", {"decode": {"replicas": 5, "maxReplicas": 3}}, "spec.decode.replicas"),
    ("ratio-min-above-max", {"autoscaling": {"ratio": {"min": 2, "max": 1}}}, "spec.autoscaling.ratio.min"),
    ("ttft-not-a-duration", {"slo": {"ttft": "fast"}}, "spec.slo.ttft"),
    ("itl-zero", {"slo": {"itl": "0s"}}, "spec.slo.itl"),
    ("kv-port-out-of-range", {"kvTransfer": {"port": 70000}}, "spec.kvTransfer.port"),
    ("kv-port-is-http-port", {"kvTransfer": {"port": 8000}}, "spec.kvTransfer.port"),
    ("router-port-zero", {"router": {"service": {"port": 0}}}, "spec.router.service.port"),
    ("unknown-mode", {"autoscaling": {"mode": "Magic"}}, "spec.autoscaling.mode"),
    ("prometheus-without-url", {"autoscaling": {"metrics": {"source": "prometheus"}}},
     "spec.autoscaling.metrics.url"),
    ("interval-below-1s", {"autoscaling": {"interval": "500ms"}}, "spec.autoscaling.interval"),
    ("timeout-negative", {"kvTransfer": {"timeout": "-5s"}}, "spec.kvTransfer.timeout"),
    ("gpu-only-requested", {"decode": {"resources": {"requests": {"nvidia.com/gpu": 1}}}},
     "spec.decode.resources.limits"),
    ("pvc-path-escapes", {"model": {"builtin": None, "pvc": {"claimName": "m", "path": "../etc"}}},
     "spec.model.pvc.path"),
    ("cache-in-two-places", {"model": {"cache": {"hostPath": "/var/cache/m", "claimName": "c"}}}, "spec.model.cache"),
    ("cache-nowhere", {"model": {"cache": {}}}, "spec.model.cache"),
    ("cache-host-path-relative", {"model": {"cache": {"hostPath": "cache"}}}, "spec.model.cache.hostPath"),
    ("negative-replicas", {"prefill": {"replicas": -1}}, "spec.prefill.replicas"),
    ("bad-failure-policy", {"kvTransfer": {"failurePolicy": "Pray"}}, "spec.kvTransfer.failurePolicy"),
    ("typo-field", {"prefill": {"replica": 2}}, "spec.prefill.replica"),
    ("drain-timeout-not-a-duration", {"drainTimeout": "forever"}, "spec.drainTimeout"),
    ("drain-timeout-zero", {"drainTimeout": "0s"}, "spec.drainTimeout"),
    ("tensor-parallel-zero", {"prefill": {"tensorParallelSize": 0}}, "spec.prefill.tensorParallelSize"),
    ("tensor-parallel-gpus-differ", {"decode": {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}},
     "spec.decode.resources.limits"),
    ("min-zero-without-scale-to-zero", {"decode": {"minReplicas": 0}}, "spec.decode.minReplicas"),
    ("prefill-placement-unknown", {"decode": {"prefillPlacement": "Sometimes"}}, "spec.decode.prefillPlacement"),
    ("idle-after-not-a-duration", {"prefill": {"minReplicas": 0}, "autoscaling": {"scaleToZero": {"idleAfter": "soon"}}},
     "spec.autoscaling.scaleToZero.idleAfter"),
]


def test_min_zero_is_legal_with_scale_to_zero_and_in_hpa_mode():
    spec = api.InferenceServiceSpec.model_validate(merged(MINIMAL, {
        "prefill": {"minReplicas": 0}, "decode": {"minReplicas": 0},
        "autoscaling": {"scaleToZero": {"idleAfter": "5m"}}}))
    assert spec.prefill.bounds()[0] == spec.decode.bounds()[0] == 0
    assert spec.autoscaling.scale_to_zero.hold_timeout == "120s"
    from phasesplit.operator.metrics.autoscale import planner_config

    cfg = planner_config(spec)
    # On in the operator: the router holds requests that find no worker and the planner wakes on them.
    assert (cfg.idle_after_s, cfg.prefill.min_replicas, cfg.local_prefill) == (300.0, 0, False)
    # Adaptive placement prefills locally where no prefill worker is ready: a held request needs
    # decode alone, and the router does not wait for prefill.
    adaptive = api.InferenceServiceSpec.model_validate(merged(spec.wire(), {"decode": {"prefillPlacement": "Adaptive"}}))
    assert planner_config(adaptive).local_prefill
    from phasesplit.operator import render

    assert "--hold-for-prefill" in render._hold_args(spec) and "--hold-for-prefill" not in render._hold_args(adaptive)
    # Without scaleToZero (legal with min 0 only outside Planner mode) nothing goes to zero.
    assert planner_config(api.InferenceServiceSpec.model_validate(MINIMAL)).idle_after_s is None
    # HPA mode renders minReplicas 0 as 1 (no HPAScaleToZero gate): legal, documented, not zero,
    # and the operator says so (a Warning Event with this message).
    from phasesplit.operator.controller import _hpa_zero

    hpa = api.InferenceServiceSpec.model_validate(merged(MINIMAL, {"decode": {"minReplicas": 0},
                                                                   "autoscaling": {"mode": "HPA"}}))
    assert "HPAScaleToZero" in _hpa_zero(hpa) and "rendered as 1" in _hpa_zero(hpa)
    assert _hpa_zero(spec) is None  # Planner mode does scale to zero
    assert _hpa_zero(api.InferenceServiceSpec.model_validate(merged(MINIMAL, {"autoscaling": {"mode": "HPA"}}))) is None


def test_minimal_object_means_what_the_issue_says():
    spec = api.InferenceServiceSpec.model_validate(MINIMAL)
    assert spec.model.builtin == "smollm2"
    assert (spec.router.replicas, spec.prefill.replicas, spec.decode.replicas) == (1, 1, 2)
    assert spec.autoscaling.mode == "Planner"
    assert spec.prefill.bounds() == (1, 4) and spec.decode.bounds() == (1, 4)
    assert spec.slo.ttft == "500ms" and spec.slo.itl == "50ms" and spec.slo.percentile == 90
    assert spec.kv_transfer.port == api.DEFAULT_KV_PORT and spec.kv_transfer.failure_policy == "RetryLocal"
    assert spec.autoscaling.behavior.scale_down.stabilization_window_seconds == 300
    assert spec.autoscaling.behavior.scale_up.stabilization_window_seconds == 0


def test_wire_form_is_camel_case_and_round_trips():
    spec = api.InferenceServiceSpec.model_validate(merged(MINIMAL, {"kvTransfer": {"failurePolicy": "Fail"}}))
    wire = spec.wire()
    assert wire["kvTransfer"]["failurePolicy"] == "Fail"
    assert "kv_transfer" not in wire
    assert api.InferenceServiceSpec.model_validate(wire) == spec


@pytest.mark.parametrize("text,seconds", [("500ms", 0.5), ("30s", 30), ("1m30s", 90), ("1.5h", 5400),
                                          ("2m", 120)])
def test_parse_duration(text, seconds):
    assert api.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "-1s", "1 s", "1d", "fast"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        api.parse_duration(text)


def test_bounds_default_around_replicas():
    assert api.PhaseSpec(replicas=0).bounds() == (0, 4)
    assert api.PhaseSpec(replicas=9).bounds() == (1, 9)
    assert api.PhaseSpec(replicas=3, min_replicas=2, max_replicas=7).bounds() == (2, 7)


@pytest.mark.parametrize("case,patch,field", INVALID_SPECS, ids=[c[0] for c in INVALID_SPECS])
def test_invalid_specs_are_rejected_naming_the_field(case, patch, field):
    with pytest.raises(ValidationError) as info:
        api.InferenceServiceSpec.model_validate(merged(MINIMAL, patch))
    locs = ["spec." + ".".join(str(p) for p in e["loc"]) for e in info.value.errors()]
    # Pydantic reports object-level rules at the object: its path is a prefix of the field.
    assert any(field.startswith(loc.rstrip(".")) for loc in locs), (locs, field)


def test_every_sample_field_is_known():
    gpu = merged(MINIMAL, {"runtime": {"kvCacheMemory": "20GiB", "maxModelLen": 8192},
                           "decode": {"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"},
                                                    "requests": {"nvidia.com/gpu": 1, "cpu": "500m"}}}})
    spec = api.InferenceServiceSpec.model_validate(gpu)
    assert spec.decode.resources.limits["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("value", ["2GiB", "2Gi", "512MiB", "1000000", "1.5GB"])
def test_kv_cache_memory_accepts_what_the_runtime_parses(value):
    from phasesplit.runtime.cli import parse_bytes

    api.RuntimeSpec(kv_cache_memory=value)
    assert parse_bytes(value) > 0


def test_status_model_accepts_planner_fields():
    status = api.InferenceServiceStatus.model_validate({
        "observedGeneration": 3,
        "prefill": {"replicas": 1, "readyReplicas": 1, "desiredReplicas": 2, "summary": "1/2"},
        "autoscaling": {"mode": "Planner",
                        "lastDecision": {"time": "2026-01-01T00:00:00Z", "reason": "TTFT p90 above target",
                                         "prefillReplicas": 2, "decodeReplicas": 3, "generation": 3},
                        "observed": {"ttftSeconds": 0.7, "itlSeconds": 0.03, "requestRate": 4.2,
                                     "attainment": 0.85}},
    })
    assert status.autoscaling.last_decision.decode_replicas == 3
