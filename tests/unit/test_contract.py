"""Contract between the halves: every container command the operator renders parses with the
runtime's own CLI parser, and means what the spec says."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from phasesplit.operator import api, render
from phasesplit.runtime.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
OWNER = render.Owner(name="chat", namespace="serving", uid="0000-1111")

EXTRA_SPECS = {
    "issue-minimal": {"model": {"name": "smollm2-135m", "builtin": "smollm2"},
                      "prefill": {"replicas": 1}, "decode": {"replicas": 2}},
    "pvc-everything": {
        "model": {"name": "llama", "pvc": {"claimName": "models", "path": "llama/model.gguf"}},
        "runtime": {"dtype": "bfloat16", "device": "cuda", "maxModelLen": 4096, "blockSize": 32,
                    "kvCacheMemory": "2GiB", "args": ["--log-level=debug"]},
        "prefill": {"maxNumBatchedTokens": 4096, "maxNumSeqs": 8},
        "decode": {"maxNumSeqs": 128, "localPrefillThreshold": 64},
        "router": {"apiKeySecretRef": {"name": "keys"}},
        "autoscaling": {"mode": "HPA"},
        "kvTransfer": {"port": 9100, "failurePolicy": "Local", "timeout": "1m30s"},
    },
    "tensor-parallel-cpu": {"model": {"name": "smollm2-135m", "builtin": "smollm2"},
                            "prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 3}},
}


def _specs() -> dict[str, api.InferenceServiceSpec]:
    specs = {p.stem: yaml.safe_load(p.read_text())["spec"] for p in sorted((ROOT / "manifests/samples").glob("*.yaml"))}
    specs.update(EXTRA_SPECS)
    return {k: api.InferenceServiceSpec.model_validate(v) for k, v in specs.items()}


SPECS = _specs()


def _containers(spec: api.InferenceServiceSpec):
    for obj in render.render(OWNER, spec):
        if obj["kind"] == "Deployment":
            yield obj["metadata"]["labels"][render.COMPONENT_LABEL], obj["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_rendered_commands_parse_with_the_runtime_parser(name):
    spec = SPECS[name]
    seen = set()
    for component, container in _containers(spec):
        assert container["command"] == ["phasesplit"]
        args = build_parser().parse_args(container["args"])
        seen.add(component)
        assert args.command == "serve" and args.role == component
        assert (args.host, args.port) == ("0.0.0.0", api.HTTP_PORT)
        assert args.model == render.model_arg(spec) and args.served_model_name == [spec.model.name]
        assert (args.dtype, args.device, args.block_size) == (spec.runtime.dtype, spec.runtime.device,
                                                              spec.runtime.block_size)
        assert args.max_model_len == spec.runtime.max_model_len
        assert args.drain_timeout == pytest.approx(api.parse_duration(spec.drain_timeout))
        if component == "decode":
            assert args.kv_port == spec.kv_transfer.port
            assert args.kv_host == "$(POD_IP)"  # expanded by the kubelet from the env below
            assert "POD_IP" in {e["name"] for e in container["env"]}
            assert args.prefill_timeout == pytest.approx(api.parse_duration(spec.kv_transfer.timeout))
            assert args.local_prefill_threshold == spec.decode.local_prefill_threshold
            # the prefill workers it may call: the prefill Service's addresses
            assert args.prefill_service == "chat-prefill"
        if component in api.PHASES:
            phase = spec.phase(component)
            assert args.max_num_seqs == (phase.max_num_seqs or 64)
            assert args.max_num_batched_tokens == (phase.max_num_batched_tokens or 512)
            assert args.tensor_parallel_size == phase.tensor_parallel_size
        if component == "router":
            assert args.discovery == "kubernetes" and args.namespace == OWNER.namespace
            assert (args.prefill_service, args.decode_service) == ("chat-prefill", "chat-decode")
    assert seen == set(api.COMPONENTS)


def test_failure_policies_map_onto_the_runtime_choices():
    base = EXTRA_SPECS["issue-minimal"]
    for policy, flag in [("Retry", "retry"), ("Local", "local"), ("Fail", "fail"), ("RetryLocal", "retry-local")]:
        spec = api.InferenceServiceSpec.model_validate({**base, "kvTransfer": {"failurePolicy": policy}})
        args = build_parser().parse_args(render.container_args(OWNER, spec, "decode"))
        assert args.on_prefill_failure == flag


def test_prefill_placement_reaches_the_decode_flags():
    base = EXTRA_SPECS["issue-minimal"]
    static = build_parser().parse_args(render.container_args(
        OWNER, api.InferenceServiceSpec.model_validate(base), "decode"))
    assert static.prefill_placement == "static"
    spec = api.InferenceServiceSpec.model_validate(
        {**base, "decode": {"prefillPlacement": "Adaptive"}, "slo": {"itl": "80ms"}})
    args = build_parser().parse_args(render.container_args(OWNER, spec, "decode"))
    assert args.prefill_placement == "adaptive" and args.itl_target == pytest.approx(0.08)
    # Adaptive also lends idle prefill workers whole requests (the router's flag).
    router = build_parser().parse_args(render.container_args(OWNER, spec, "router"))
    assert router.lend_idle_prefill
    assert not build_parser().parse_args(render.container_args(
        OWNER, api.InferenceServiceSpec.model_validate(base), "router")).lend_idle_prefill
    # Not a K/V layout change: no new revision, no paired rollout of prefill.
    assert render.revision(spec) == render.revision(api.InferenceServiceSpec.model_validate(base))


def test_volume_sources_reach_the_model_flag():
    spec = SPECS["pvc-everything"]
    assert render.model_arg(spec) == "/models/llama/model.gguf"
    host = api.InferenceServiceSpec.model_validate(
        {"model": {"name": "m", "hostPath": {"directory": "/data"}}})
    assert render.model_arg(host) == "/models"


def test_extra_args_and_kv_cache_memory_parse():
    spec = SPECS["pvc-everything"]
    for _, container in _containers(spec):
        args = build_parser().parse_args(container["args"])
        assert args.log_level == "debug"
        if args.role in api.PHASES:
            assert args.kv_cache_memory == 2 * 1024**3
