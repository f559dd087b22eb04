"""Pure rendering: the children an InferenceService wants, field by field."""

from __future__ import annotations

import copy

from phasesplit.operator import api, render
from phasesplit.runtime import metric_names as names

OWNER = render.Owner(name="chat", namespace="serving", uid="uid-1")
MINIMAL = {"model": {"name": "smollm2-135m", "builtin": "smollm2"}, "prefill": {"replicas": 1},
           "decode": {"replicas": 2}}


def spec_of(**patch) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({**copy.deepcopy(MINIMAL), **patch})


def by_key(spec: api.InferenceServiceSpec, replicas=None) -> dict[tuple[str, str], dict]:
    return {render.key(o): o for o in render.render(OWNER, spec, replicas)}


def pod(objs, component):
    return objs[("Deployment", f"chat-{component}")]["spec"]["template"]["spec"]


def test_minimal_renders_the_full_set():
    objs = by_key(spec_of())
    assert sorted(objs) == sorted([
        ("ServiceAccount", "chat-router"), ("Role", "chat-router"), ("RoleBinding", "chat-router"),
        ("Service", "chat-router"), ("Service", "chat-prefill"), ("Service", "chat-decode"),
        ("Deployment", "chat-prefill"), ("Deployment", "chat-decode"), ("Deployment", "chat-router"),
        ("PodDisruptionBudget", "chat-prefill"), ("PodDisruptionBudget", "chat-decode"),
        ("PodDisruptionBudget", "chat-router"),
        ("NetworkPolicy", "chat-prefill"), ("NetworkPolicy", "chat-decode"),
    ])
    replicas = {c: objs[("Deployment", f"chat-{c}")]["spec"]["replicas"] for c in api.COMPONENTS}
    assert replicas == {"prefill": 1, "decode": 2, "router": 1}


def test_every_child_is_owned_labelled_and_namespaced():
    for obj in render.render(OWNER, spec_of()):
        meta = obj["metadata"]
        assert meta["namespace"] == "serving"
        (ref,) = meta["ownerReferences"]
        assert ref == {"apiVersion": "serving.phasesplit.io/v1alpha1", "kind": "InferenceService", "name": "chat",
                       "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "phasesplit"
        assert labels["app.kubernetes.io/instance"] == "chat"
        assert labels["app.kubernetes.io/managed-by"] == render.MANAGED_BY
        assert labels["app.kubernetes.io/component"] in api.COMPONENTS
        assert "app.kubernetes.io/part-of" in labels and "app.kubernetes.io/version" in labels


def test_rendering_is_deterministic():
    assert render.render(OWNER, spec_of()) == render.render(OWNER, spec_of())


def test_pods_are_locked_down():
    objs = by_key(spec_of())
    for component in api.COMPONENTS:
        spec = pod(objs, component)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (c,) = spec["containers"]
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HOME"] == "/tmp" and env["XDG_CACHE_HOME"] == "/tmp/cache"
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert c["startupProbe"]["httpGet"]["path"] == "/health"
        assert c["ports"][0] == {"name": "http", "containerPort": 8000, "protocol": "TCP"}
    assert pod(objs, "router")["serviceAccountName"] == "chat-router"
    assert pod(objs, "prefill")["automountServiceAccountToken"] is False
    assert pod(objs, "decode")["automountServiceAccountToken"] is False
    kv = [p for p in pod(objs, "decode")["containers"][0]["ports"] if p["name"] == "kv"]
    assert kv == [{"name": "kv", "containerPort": 9000, "protocol": "TCP"}]


def test_deployment_selector_matches_template_and_services():
    objs = by_key(spec_of())
    for component in api.COMPONENTS:
        dep = objs[("Deployment", f"chat-{component}")]
        sel = dep["spec"]["selector"]["matchLabels"]
        assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert objs[("Service", f"chat-{component}")]["spec"]["selector"] == sel
        assert objs[("PodDisruptionBudget", f"chat-{component}")]["spec"] == {
            "maxUnavailable": 1, "selector": {"matchLabels": sel}}


def test_services_router_exposed_phases_headless():
    objs = by_key(spec_of(router={"service": {"type": "LoadBalancer", "port": 8080,
                                              "annotations": {"lb": "internal"}}}))
    router = objs[("Service", "chat-router")]
    assert router["spec"]["type"] == "LoadBalancer" and router["metadata"]["annotations"] == {"lb": "internal"}
    assert router["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    for phase in api.PHASES:
        assert objs[("Service", f"chat-{phase}")]["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in objs[("Service", "chat-decode")]["spec"]["ports"]] == ["http", "kv"]


def test_router_rbac_reads_endpointslices_only():
    objs = by_key(spec_of())
    assert objs[("Role", "chat-router")]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    binding = objs[("RoleBinding", "chat-router")]
    assert binding["roleRef"]["name"] == "chat-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "serving"}]


def test_network_policies_admit_only_the_split_traffic():
    objs = by_key(spec_of(kvTransfer={"port": 9100}))
    sel = {c: render.selector(OWNER, c) for c in api.COMPONENTS}
    prefill = objs[("NetworkPolicy", "chat-prefill")]["spec"]
    assert prefill["podSelector"] == {"matchLabels": sel["prefill"]}
    assert prefill["policyTypes"] == ["Ingress"]
    sources = [([p.get("podSelector", {}).get("matchLabels") for p in r["from"]], r["ports"]) for r in prefill["ingress"]]
    assert sources[0] == ([sel["router"], sel["decode"]], [{"protocol": "TCP", "port": 8000}])
    decode = objs[("NetworkPolicy", "chat-decode")]["spec"]["ingress"]
    assert decode[0]["from"] == [{"podSelector": {"matchLabels": sel["router"]}}]
    assert decode[1] == {"from": [{"podSelector": {"matchLabels": sel["prefill"]}}],
                         "ports": [{"protocol": "TCP", "port": 9100}]}
    # The last rule of each admits the operator's metric scrapes from its own namespace, HTTP only.
    for rules in (prefill["ingress"], decode):
        assert rules[-1]["from"][0]["podSelector"]["matchLabels"] == render.OPERATOR_POD_LABELS
        assert rules[-1]["from"][0]["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": "phasesplit-system"}}
        assert rules[-1]["ports"] == [{"protocol": "TCP", "port": 8000}]
    moved = by_key(spec_of(networkPolicy={"operatorNamespace": "ops"}))
    rule = moved[("NetworkPolicy", "chat-decode")]["spec"]["ingress"][-1]["from"][0]
    assert rule["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    off = by_key(spec_of(networkPolicy={"enabled": False}))
    assert not [k for k in off if k[0] == "NetworkPolicy"]


def test_model_volumes_are_read_only():
    objs = by_key(spec_of(model={"name": "m", "pvc": {"claimName": "weights", "path": "a/b.gguf"}}))
    spec = pod(objs, "decode")
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in spec["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]
    objs = by_key(spec_of(model={"name": "m", "hostPath": {"directory": "/srv/models"}}))
    assert {"name": "model", "hostPath": {"path": "/srv/models", "type": "Directory"}} in pod(objs, "router")["volumes"]


def test_model_cache_volume_is_shared_and_writable():
    # Without a cache: only the pod's own emptyDir, and no PHASESPLIT_CACHE (the runtime's default).
    plain = pod(by_key(spec_of()), "decode")
    assert [v["name"] for v in plain["volumes"]] == ["tmp"]
    assert "PHASESPLIT_CACHE" not in {e["name"] for e in plain["containers"][0]["env"]}
    for cache, volume in (
            ({"hostPath": "/var/cache/phasesplit"},
             {"hostPath": {"path": "/var/cache/phasesplit", "type": "DirectoryOrCreate"}}),
            ({"claimName": "models"}, {"persistentVolumeClaim": {"claimName": "models"}})):
        objs = by_key(spec_of(model={"name": "m", "builtin": "smollm2", "cache": cache}))
        for component in api.COMPONENTS:  # the router reads the tokenizer from it too
            spec = pod(objs, component)
            c = spec["containers"][0]
            assert {"name": "model-cache", **volume} in spec["volumes"]
            assert {"name": "model-cache", "mountPath": render.CACHE_MOUNT} in c["volumeMounts"]
            assert {"name": "PHASESPLIT_CACHE", "value": render.CACHE_MOUNT} in c["env"]
    # Where the converted weights are kept moves no K/V.
    assert render.revision(spec_of(model={"name": "smollm2-135m", "builtin": "smollm2",
                                          "cache": {"claimName": "models"}})) == render.revision(spec_of())


def test_placement_resources_and_api_key():
    objs = by_key(spec_of(
        decode={"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}, "nodeSelector": {"gpu": "h100"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "affinity": {"podAntiAffinity": {}}},
        router={"apiKeySecretRef": {"name": "keys", "key": "token"}},
        runtime={"image": "example/rt:1", "imagePullPolicy": "Always", "imagePullSecrets": [{"name": "reg"}],
                 "env": [{"name": "A", "value": "1"}]}))
    decode = pod(objs, "decode")
    assert decode["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert decode["nodeSelector"] == {"gpu": "h100"}
    assert decode["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert decode["affinity"] == {"podAntiAffinity": {}}
    assert decode["imagePullSecrets"] == [{"name": "reg"}]
    assert decode["containers"][0]["image"] == "example/rt:1"
    assert decode["containers"][0]["imagePullPolicy"] == "Always"
    assert {"name": "A", "value": "1"} in decode["containers"][0]["env"]
    key_env = {"name": "PHASESPLIT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "token"}}}
    assert key_env in pod(objs, "router")["containers"][0]["env"]
    assert key_env not in decode["containers"][0]["env"]


def test_hpa_mode_renders_autoscalers_and_leaves_replicas_to_them():
    spec = spec_of(prefill={"replicas": 1, "maxReplicas": 3}, decode={"replicas": 2, "minReplicas": 0},
                   autoscaling={"mode": "HPA", "hpaTargets": {"decodeKvCacheUsage": 0.75},
                                "behavior": {"scaleUp": {"policies": [{"type": "Pods", "value": 2,
                                                                       "periodSeconds": 30}]}}})
    objs = by_key(spec)
    for phase in api.PHASES:
        assert "replicas" not in objs[("Deployment", f"chat-{phase}")]["spec"]
    assert objs[("Deployment", "chat-router")]["spec"]["replicas"] == 1
    prefill = objs[("HorizontalPodAutoscaler", "chat-prefill")]["spec"]
    assert prefill["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat-prefill"}
    assert (prefill["minReplicas"], prefill["maxReplicas"]) == (1, 3)
    assert [m["pods"]["metric"]["name"] for m in prefill["metrics"]] == [names.PREFILL_QUEUE_TOKENS]
    decode = objs[("HorizontalPodAutoscaler", "chat-decode")]["spec"]
    assert decode["minReplicas"] == 1  # an HPA cannot go to zero
    assert [m["pods"]["metric"]["name"] for m in decode["metrics"]] == [
        names.WAITING, names.KV_USAGE]
    assert decode["metrics"][1]["pods"]["target"] == {"type": "AverageValue", "averageValue": "750m"}
    assert decode["behavior"]["scaleUp"] == {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                                             "policies": [{"type": "Pods", "value": 2, "periodSeconds": 30}]}
    assert decode["behavior"]["scaleDown"] == {"stabilizationWindowSeconds": 300, "selectPolicy": "Max"}
    assert not [k for k in by_key(spec_of()) if k[0] == "HorizontalPodAutoscaler"]


def test_desired_replicas_seam_for_the_planner():
    spec = spec_of(prefill={"replicas": 1, "maxReplicas": 3}, decode={"replicas": 2})
    assert render.desired_replicas(spec) == {"router": 1, "prefill": 1, "decode": 2}
    decision = render.PlannedReplicas(prefill=9, decode=3, generation=4)
    # The planner's decision wins within bounds (prefill capped at maxReplicas=3)...
    assert render.desired_replicas(spec, decision, generation=4) == {"router": 1, "prefill": 3, "decode": 3}
    # ...until the spec is edited (a newer generation): the edit wins until the next decision.
    assert render.desired_replicas(spec, decision, generation=5) == {"router": 1, "prefill": 1, "decode": 2}
    disabled = spec_of(autoscaling={"mode": "Disabled"})
    assert render.desired_replicas(disabled, decision, 4) == {"router": 1, "prefill": 1, "decode": 2}
    hpa = spec_of(autoscaling={"mode": "HPA"})
    assert render.desired_replicas(hpa) == {"router": 1, "prefill": None, "decode": None}


def test_pods_drain_before_they_go():
    """Every pod gets the preStop delay and a grace period covering the drain timeout, and its
    runtime the same drain timeout (issue 13: scale-downs and rollouts cut nothing)."""
    for spec, drain_s in ((spec_of(), 300), (spec_of(drainTimeout="20m"), 1200), (spec_of(drainTimeout="90s"), 90)):
        objs = by_key(spec)
        for c in api.COMPONENTS:
            p = pod(objs, c)
            assert p["terminationGracePeriodSeconds"] == render.PRESTOP_DELAY_S + drain_s + render.GRACE_MARGIN_S
            container = p["containers"][0]
            assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": render.PRESTOP_DELAY_S}}}
            assert f"--drain-timeout={drain_s}s" in container["args"]


def test_every_pod_gets_the_internal_secret_from_the_services_secret():
    from phasesplit.runtime import internal_secret
    objs = by_key(spec_of())
    for c in api.COMPONENTS:
        env = {e["name"]: e for e in pod(objs, c)["containers"][0]["env"]}
        assert env[internal_secret.ENV]["valueFrom"] == {"secretKeyRef": {
            "name": "chat-internal", "key": render.INTERNAL_SECRET_KEY}}
    assert ("Secret", "chat-internal") not in objs, "never applied: its random value is made once"
    secret = render.internal_secret(OWNER, "v" * 43)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert secret["stringData"] == {render.INTERNAL_SECRET_KEY: "v" * 43}


def test_tensor_parallel_pods_get_one_gpu_per_rank_and_the_flag():
    objs = by_key(spec_of(runtime={"device": "cuda"}, prefill={"tensorParallelSize": 2},
                          decode={"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 4, "memory": "8Gi"}}}))
    prefill, decode = pod(objs, "prefill")["containers"][0], pod(objs, "decode")["containers"][0]
    assert prefill["resources"] == {"limits": {"nvidia.com/gpu": 2}}  # filled in: one per rank
    assert decode["resources"] == {"limits": {"nvidia.com/gpu": 4, "memory": "8Gi"}}  # as written
    assert "--tensor-parallel-size=2" in prefill["args"] and "--tensor-parallel-size=4" in decode["args"]
    router = pod(objs, "router")["containers"][0]
    assert not any(a.startswith("--tensor-parallel-size") for a in router["args"]) and "limits" not in router["resources"]
    # On CPU the ranks share the pod's CPUs: no GPUs are asked for; TP=1 renders no flag at all.
    objs = by_key(spec_of(runtime={"device": "cpu"}, prefill={"tensorParallelSize": 2}))
    assert "limits" not in pod(objs, "prefill")["containers"][0]["resources"]
    assert "--tensor-parallel-size=2" in pod(objs, "prefill")["containers"][0]["args"]
    assert not any(a.startswith("--tensor-parallel-size") for a in pod(objs, "decode")["containers"][0]["args"])


def test_revision_changes_exactly_when_a_kv_relevant_field_changes():
    base = render.revision(spec_of())
    kv_relevant = {
        "dtype": {"runtime": {"dtype": "float32"}},
        "block size": {"runtime": {"blockSize": 32}},
        "image": {"runtime": {"image": "ghcr.io/phasesplit/runtime:0.2.0"}},
        "device": {"runtime": {"device": "cpu"}},
        "args": {"runtime": {"args": ["--no-prefix-caching"]}},
        "model source": {"model": {"name": "smollm2-135m", "hostPath": {"directory": "/m", "path": "smollm2"}}},
    }
    seen = {base}
    for what, patch in kv_relevant.items():
        r = render.revision(spec_of(**patch))
        assert r not in seen, f"changing the {what} must change the revision"
        seen.add(r)
    irrelevant = {
        "served name": {"model": {"name": "another-name", "builtin": "smollm2"}},
        "replicas": {"decode": {"replicas": 5}},
        "resources": {"prefill": {"replicas": 1, "resources": {"requests": {"cpu": "2"}}}},
        "max model len": {"runtime": {"maxModelLen": 1024}},
        "kv cache memory": {"runtime": {"kvCacheMemory": "1Gi"}},
        "drain timeout": {"drainTimeout": "30s"},
    }
    for what, patch in irrelevant.items():
        assert render.revision(spec_of(**patch)) == base, f"the {what} moves no K/V: same revision"


def test_phase_pods_carry_their_revision_as_label_and_flag():
    spec = spec_of(runtime={"blockSize": 32})
    objs = by_key(spec)
    rev = render.revision(spec)
    for component in ("prefill", "decode"):
        tmpl = objs[("Deployment", f"chat-{component}")]["spec"]["template"]
        assert tmpl["metadata"]["labels"][render.REVISION_LABEL] == rev
        assert f"--revision={rev}" in tmpl["spec"]["containers"][0]["args"]
        # Not in the selector (immutable): a rollout changes the label, not the Deployment's identity.
        sel = objs[("Deployment", f"chat-{component}")]["spec"]["selector"]["matchLabels"]
        assert render.REVISION_LABEL not in sel
    router = objs[("Deployment", "chat-router")]["spec"]["template"]
    assert render.REVISION_LABEL not in router["metadata"]["labels"]
    assert not any(a.startswith("--revision") for a in router["spec"]["containers"][0]["args"])


def test_scale_to_zero_sets_the_routers_held_queue():
    def router_args(spec):
        return pod(by_key(spec), "router")["containers"][0]["args"]

    assert not any(a.startswith("--hold") or a.startswith("--max-held") for a in router_args(spec_of()))
    zero = {"scaleToZero": {"idleAfter": "5m", "holdTimeout": "90s", "maxHeld": 32}}
    both = spec_of(prefill={"replicas": 1, "minReplicas": 0}, decode={"replicas": 1, "minReplicas": 0},
                   autoscaling=zero)
    args = router_args(both)
    assert "--hold-timeout=90s" in args and "--max-held=32" in args
    assert "--hold-for-prefill" in args  # decode may not prefill locally: a held request waits for both
    local = spec_of(prefill={"replicas": 1, "minReplicas": 0},
                    decode={"replicas": 1, "minReplicas": 0, "localPrefillThreshold": 256}, autoscaling=zero)
    assert "--hold-for-prefill" not in router_args(local)
    # HPA mode cannot scale to zero (no HPAScaleToZero gate): scaleToZero changes nothing there.
    hpa = spec_of(decode={"replicas": 1, "minReplicas": 0}, autoscaling={**zero, "mode": "HPA"})
    assert not any(a.startswith("--hold") for a in router_args(hpa))
