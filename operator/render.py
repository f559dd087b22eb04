"""Pure rendering: an InferenceService spec in, the desired child objects out (plain dicts).

No I/O and no clock: the same input always gives the same objects, which is what makes
server-side apply idempotent (a restarted operator re-applies byte-identical intent and nothing
rolls) and what lets the unit tests check every field without a cluster.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from phasesplit.operator import api
from phasesplit.runtime import internal_secret as internal
from phasesplit.runtime import metric_names
from phasesplit.runtime.version import VERSION

MANAGED_BY = "phasesplit-operator"
APP_NAME = "phasesplit"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# On prefill and decode pods (not in any selector): which workers may exchange K/V (revision()).
REVISION_LABEL = "phasesplit.io/revision"
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": APP_NAME, COMPONENT_LABEL: "operator"}
API_KEY_ENV = "PHASESPLIT_API_KEY"
MODEL_MOUNT = "/models"
# The model cache volume (spec.model.cache), where the runtime's PHASESPLIT_CACHE points.
CACHE_MOUNT = "/var/cache/phasesplit"
RUNTIME_UID = 1000
# Seconds a terminating pod keeps serving before SIGTERM, while its endpoint is marked
# terminating: the router's EndpointSlice watch and the Services stop sending to it first.
PRESTOP_DELAY_S = 5
GRACE_MARGIN_S = 10  # after the drain timeout: the process's own shutdown



@dataclass(frozen=True)
class ChildKind:
    """A kind of object the operator renders: how to address it in the API."""

    api_version: str  # "v1" for the core group, else "group/version"
    plural: str
    kind: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


# Every kind render() may produce, in apply order (RBAC before pods): what the operator watches,
# lists on resync and prunes.
CHILD_KINDS: tuple[ChildKind, ...] = (
    ChildKind("v1", "serviceaccounts", "ServiceAccount"),
    ChildKind("rbac.authorization.k8s.io/v1", "roles", "Role"),
    ChildKind("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
    ChildKind("v1", "services", "Service"),
    ChildKind("apps/v1", "deployments", "Deployment"),
    ChildKind("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    ChildKind("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy"),
    ChildKind("autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler"),
)


@dataclass(frozen=True)
class PlannedReplicas:
    """The planner's latest decision as render needs it: replicas per phase and the spec
    generation it was made under (handed over in memory; after a restart, read back once from
    status.autoscaling.lastDecision)."""

    prefill: int | None
    decode: int | None
    generation: int | None = None


@dataclass(frozen=True)
class Owner:
    """The InferenceService the children belong to."""

    name: str
    namespace: str
    uid: str

    def child(self, component: str) -> str:
        return f"{self.name}-{component}"


def labels(owner: Owner, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP_NAME,
        INSTANCE_LABEL: owner.name,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/part-of": APP_NAME,
        MANAGED_BY_LABEL: MANAGED_BY,
        "app.kubernetes.io/version": VERSION,
    }


def selector(owner: Owner, component: str) -> dict[str, str]:
    """Pod selector of a component: immutable on Deployments, so it never includes the version."""
    return {"app.kubernetes.io/name": APP_NAME, INSTANCE_LABEL: owner.name, COMPONENT_LABEL: component}


def children_selector(owner: Owner) -> str:
    """Label selector (string form) matching every child of one InferenceService."""
    return f"{MANAGED_BY_LABEL}={MANAGED_BY},{INSTANCE_LABEL}={owner.name}"


def _meta(owner: Owner, component: str, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or owner.child(component),
        "namespace": owner.namespace,
        "labels": labels(owner, component),
        "ownerReferences": [{
            "apiVersion": api.API_VERSION, "kind": api.KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True,
        }],
    }


def _seconds(duration: str) -> str:
    """A spec duration as the runtime's flag syntax (it accepts one unit: plain seconds)."""
    return f"{api.parse_duration(duration):g}s"


# ---------------------------------------------------------------------------------------------
# container command lines: the contract with runtime/cli.py


def model_arg(spec: api.InferenceServiceSpec) -> str:
    source = spec.model
    if source.builtin:
        return source.builtin
    path = (source.pvc.path if source.pvc else source.host_path.path) or ""
    return f"{MODEL_MOUNT}/{path}".rstrip("/")


def revision(spec: api.InferenceServiceSpec) -> str:
    """A hash of everything that decides whether a prefill worker's K/V means the same to a
    decode worker: the model source, the image (the code that computes and lays out K/V), the
    device and dtype (auto resolves per device), the block size, and the free-form args (any of
    which may change the layout; the operator cannot tell which do). The router pairs a decode
    worker only with prefill workers of the same revision, so that during a rollout old and new
    pairs serve side by side and no request mixes them. The served name, resources, replicas and
    placement are left out: changing them moves no K/V."""
    rt = spec.runtime
    # The cache only decides where converted weights are kept: the same model gives the same K/V.
    kv_relevant = {"model": {k: v for k, v in spec.model.wire().items() if k not in ("name", "cache")},
                   "image": rt.image,
                   "device": rt.device, "dtype": rt.dtype, "blockSize": rt.block_size, "args": list(rt.args)}
    return hashlib.sha256(json.dumps(kv_relevant, sort_keys=True).encode()).hexdigest()[:12]


_FAILURE_POLICY = {"Retry": "retry", "Local": "local", "Fail": "fail", "RetryLocal": "retry-local"}


def container_args(owner: Owner, spec: api.InferenceServiceSpec, component: str) -> list[str]:
    """Arguments after `phasesplit` for one component's container."""
    rt = spec.runtime
    args = ["serve", f"--role={component}", "--host=0.0.0.0", f"--port={api.HTTP_PORT}",
            f"--model={model_arg(spec)}", f"--served-model-name={spec.model.name}",
            f"--device={rt.device}", f"--dtype={rt.dtype}", f"--block-size={rt.block_size}"]
    if rt.max_model_len:
        args.append(f"--max-model-len={rt.max_model_len}")
    if component in api.PHASES:
        phase = spec.phase(component)
        args.append(f"--revision={revision(spec)}")
        if rt.kv_cache_memory:
            args.append(f"--kv-cache-memory={rt.kv_cache_memory}")
        if phase.max_num_seqs:
            args.append(f"--max-num-seqs={phase.max_num_seqs}")
        if phase.max_num_batched_tokens:
            args.append(f"--max-num-batched-tokens={phase.max_num_batched_tokens}")
        if phase.tensor_parallel_size > 1:
            args.append(f"--tensor-parallel-size={phase.tensor_parallel_size}")
    if component == "decode":
        kv = spec.kv_transfer
        # --prefill-service: the headless Service whose addresses are the prefill workers this
        # decode worker may call (it follows no prefill URL from a request body on trust).
        args += [f"--kv-port={kv.port}", "--kv-host=$(POD_IP)", f"--prefill-service={owner.child('prefill')}",
                 f"--on-prefill-failure={_FAILURE_POLICY[kv.failure_policy]}",
                 f"--prefill-timeout={_seconds(kv.timeout)}",
                 f"--local-prefill-threshold={spec.decode.local_prefill_threshold}"]
        if spec.decode.prefill_placement == "Adaptive":
            # The decode pool's own ITL target bounds what a local prefill may add to a step.
            args += ["--prefill-placement=adaptive", f"--itl-target={_seconds(spec.slo.itl)}"]
    args.append(f"--drain-timeout={_seconds(spec.drain_timeout)}")
    if component == "router":
        args += ["--discovery=kubernetes", f"--namespace={owner.namespace}",
                 f"--prefill-service={owner.child('prefill')}", f"--decode-service={owner.child('decode')}",
                 f"--api-key-env={API_KEY_ENV}"]
        args += _hold_args(spec)
        if spec.decode.prefill_placement == "Adaptive":  # idle prefill workers serve whole requests too
            args.append("--lend-idle-prefill")
    return args + list(rt.args)


def _hold_args(spec: api.InferenceServiceSpec) -> list[str]:
    """The router's held queue as scaleToZero sets it (else the runtime's defaults). Where prefill
    may go to zero and decode may not prefill locally, a held request waits for both phases, as
    the planner wakes both (planner.py)."""
    zero = spec.autoscaling.scale_to_zero
    if zero is None or spec.autoscaling.mode != "Planner":
        return []
    out = [f"--hold-timeout={_seconds(zero.hold_timeout)}", f"--max-held={zero.max_held}"]
    # Adaptive placement prefills locally when no prefill worker is ready, so decode alone serves.
    static_only_remote = spec.decode.local_prefill_threshold == 0 and spec.decode.prefill_placement == "Static"
    if spec.prefill.bounds()[0] == 0 and static_only_remote:
        out.append("--hold-for-prefill")
    return out


# ---------------------------------------------------------------------------------------------
# pods


def _volumes(spec: api.InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    # The root filesystem is read-only; the runtime writes its converted-model cache under $HOME
    # (the pod's emptyDir), or in spec.model.cache's volume, which outlives the pod.
    volumes = [{"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    source = spec.model
    if source.pvc:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": source.pvc.claim_name,
                                                                     "readOnly": True}})
    elif source.host_path:
        volumes.append({"name": "model", "hostPath": {"path": source.host_path.directory, "type": "Directory"}})
    if source.pvc or source.host_path:
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    cache = source.cache
    if cache:
        # Written by the pods (the first converts, the others read): never read-only.
        volumes.append({"name": "model-cache", **(
            {"hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}} if cache.host_path
            else {"persistentVolumeClaim": {"claimName": cache.claim_name}})})
        mounts.append({"name": "model-cache", "mountPath": CACHE_MOUNT})
    return volumes, mounts


def _env(owner: Owner, spec: api.InferenceServiceSpec, component: str) -> list[dict[str, Any]]:
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"},
    ]
    if spec.model.cache:
        env.append({"name": "PHASESPLIT_CACHE", "value": CACHE_MOUNT})
    # Every pod of the service holds the internal secret (its /internal/* calls and KV handshakes).
    env.append({"name": internal.ENV, "valueFrom": {"secretKeyRef": {"name": internal_secret_name(owner),
                                                                      "key": INTERNAL_SECRET_KEY}}})
    ref = spec.router.api_key_secret_ref
    if component == "router" and ref:
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env + [e.wire() for e in spec.runtime.env]


INTERNAL_SECRET_KEY = "secret"


def internal_secret_name(owner: Owner) -> str:
    return owner.child("internal")


def internal_secret(owner: Owner, value: str) -> dict[str, Any]:
    """The service's internal secret, owned by it (garbage-collected with it). The value is
    random and made once at the I/O edge (reconcile.ensure_internal_secret), which creates this
    object only when absent and never applies it again, so the value is not rendered twice."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(owner, "internal"), "type": "Opaque",
            "stringData": {INTERNAL_SECRET_KEY: value}}


def _probe(path: str, **timing: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, **timing}


def _resources(spec: api.InferenceServiceSpec, component: str) -> dict[str, Any]:
    """The container's resources; a tensor-parallel CUDA pod gets one GPU per rank (validation
    has checked that GPU limits the spec names match the rank count)."""
    placement: api.Placement = spec.router if component == "router" else spec.phase(component)
    res = placement.resources.wire()
    if component in api.PHASES and spec.runtime.device == "cuda":
        tp = spec.phase(component).tensor_parallel_size
        if tp > 1 and api.GPU not in res.get("limits", {}):
            res["limits"] = {**res.get("limits", {}), api.GPU: tp}
    return res


def pod_template(owner: Owner, spec: api.InferenceServiceSpec, component: str) -> dict[str, Any]:
    placement: api.Placement = spec.router if component == "router" else spec.phase(component)
    volumes, mounts = _volumes(spec)
    ports = [{"name": "http", "containerPort": api.HTTP_PORT, "protocol": "TCP"}]
    if component == "decode":
        ports.append({"name": "kv", "containerPort": spec.kv_transfer.port, "protocol": "TCP"})
    container = {
        "name": "runtime",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["phasesplit"],
        "args": container_args(owner, spec, component),
        "ports": ports,
        "env": _env(owner, spec, component),
        "resources": _resources(spec, component),
        "volumeMounts": mounts,
        # Loading (and on first start converting) the model can take minutes: the startup probe
        # holds liveness off until /health answers, readiness waits for the model (/ready).
        "startupProbe": _probe("/health", periodSeconds=5, failureThreshold=120),
        "livenessProbe": _probe("/health", periodSeconds=10, timeoutSeconds=5, failureThreshold=3),
        "readinessProbe": _probe("/ready", periodSeconds=5, timeoutSeconds=5, failureThreshold=3),
        # Drain, never cut: the delay lets discovery drop the pod before SIGTERM, after which the
        # runtime finishes what it holds within --drain-timeout (runtime/server/drain.py).
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_DELAY_S}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID, "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
    }
    if component == "router":
        pod["serviceAccountName"] = owner.child("router")
    else:
        pod["automountServiceAccountToken"] = False  # workers never call the API server
    if spec.runtime.image_pull_secrets:
        pod["imagePullSecrets"] = [s.wire() for s in spec.runtime.image_pull_secrets]
    if placement.node_selector:
        pod["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod["tolerations"] = [t.wire() for t in placement.tolerations]
    if placement.affinity:
        pod["affinity"] = placement.affinity
    pod_labels = labels(owner, component)
    if component in api.PHASES:
        pod_labels[REVISION_LABEL] = revision(spec)
    return {
        "metadata": {
            "labels": pod_labels,
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(api.HTTP_PORT),
                            "prometheus.io/path": "/metrics"},
        },
        "spec": pod,
    }


def termination_grace_seconds(spec: api.InferenceServiceSpec) -> int:
    return PRESTOP_DELAY_S + math.ceil(api.parse_duration(spec.drain_timeout)) + GRACE_MARGIN_S


def deployment(owner: Owner, spec: api.InferenceServiceSpec, component: str,
               replicas: int | None) -> dict[str, Any]:
    """replicas None leaves the field out so that another manager (the HPA) owns it."""
    body: dict[str, Any] = {
        "selector": {"matchLabels": selector(owner, component)},
        "template": pod_template(owner, spec, component),
        "revisionHistoryLimit": 3,
        # A worker that is not ready serves nothing: surge first, then retire old pods.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
    }
    if replicas is not None:
        body = {"replicas": replicas, **body}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(owner, component), "spec": body}


# ---------------------------------------------------------------------------------------------
# services, RBAC, disruption budgets, network policies, autoscalers


def services(owner: Owner, spec: api.InferenceServiceSpec) -> list[dict[str, Any]]:
    svc = spec.router.service
    router_meta = _meta(owner, "router")
    if svc.annotations:
        router_meta["annotations"] = dict(svc.annotations)
    router = {"apiVersion": "v1", "kind": "Service", "metadata": router_meta, "spec": {
        "type": svc.type,
        "selector": selector(owner, "router"),
        "ports": [{"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}],
    }}
    out = [router]
    # Headless Services per phase: the router discovers workers from their EndpointSlices.
    for phase in api.PHASES:
        ports = [{"name": "http", "port": api.HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]
        if phase == "decode":
            ports.append({"name": "kv", "port": spec.kv_transfer.port, "targetPort": "kv", "protocol": "TCP"})
        out.append({"apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, phase), "spec": {
            "clusterIP": "None", "selector": selector(owner, phase), "ports": ports,
            "publishNotReadyAddresses": False,
        }})
    return out


def router_rbac(owner: Owner) -> list[dict[str, Any]]:
    name = owner.child("router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(owner, "router")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(owner, "router"),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(owner, "router"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]},
    ]


def disruption_budgets(owner: Owner) -> list[dict[str, Any]]:
    # maxUnavailable (not minAvailable) so that a one-replica pool never blocks a node drain.
    return [{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(owner, c),
             "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(owner, c)}}}
            for c in api.COMPONENTS]


def _peer(owner: Owner, component: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": selector(owner, component)}}


def network_policies(owner: Owner, spec: api.InferenceServiceSpec) -> list[dict[str, Any]]:
    """Fence the workers: only the router, the other phase and the operator's scrapes get in.

    Decode workers call prefill workers over HTTP (the decode worker owns each request and asks a
    prefill worker to fill its reserved blocks), and prefill workers push KV to decode's KV port.
    """
    http = [{"protocol": "TCP", "port": api.HTTP_PORT}]
    kv = [{"protocol": "TCP", "port": spec.kv_transfer.port}]
    # The operator's pods in the operator's namespace only (an empty selector matched its labels
    # in any namespace, which anyone who can create a pod could copy).
    operator = {"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": spec.network_policy.operator_namespace}},
                "podSelector": {"matchLabels": OPERATOR_POD_LABELS}}
    rules = {
        "prefill": [{"from": [_peer(owner, "router"), _peer(owner, "decode")], "ports": http}],
        "decode": [{"from": [_peer(owner, "router")], "ports": http},
                   {"from": [_peer(owner, "prefill")], "ports": kv}],
    }
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(owner, phase),
             "spec": {"podSelector": {"matchLabels": selector(owner, phase)}, "policyTypes": ["Ingress"],
                      "ingress": rules[phase] + [{"from": [operator], "ports": http}]}}
            for phase in api.PHASES]


def _hpa_rules(rules: api.ScalingRules) -> dict[str, Any]:
    out: dict[str, Any] = {"stabilizationWindowSeconds": rules.stabilization_window_seconds,
                           "selectPolicy": rules.select_policy}
    if rules.policies:
        out["policies"] = [p.wire() for p in rules.policies]
    return out


def _pods_metric(name: str, average: str) -> dict[str, Any]:
    return {"type": "Pods", "pods": {"metric": {"name": name},
                                     "target": {"type": "AverageValue", "averageValue": average}}}


def autoscalers(owner: Owner, spec: api.InferenceServiceSpec) -> list[dict[str, Any]]:
    targets = spec.autoscaling.hpa_targets
    metrics = {
        "prefill": [_pods_metric(metric_names.PREFILL_QUEUE_TOKENS, str(targets.prefill_queue_tokens))],
        "decode": [_pods_metric(metric_names.WAITING, str(targets.decode_requests_waiting)),
                   _pods_metric(metric_names.KV_USAGE, f"{round(targets.decode_kv_cache_usage * 1000)}m")],
    }
    behavior = spec.autoscaling.behavior
    out = []
    for phase in api.PHASES:
        low, high = spec.phase(phase).bounds()
        low = max(1, low)  # the HPA cannot scale to zero without an alpha feature gate
        out.append({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                    "metadata": _meta(owner, phase), "spec": {
                        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": owner.child(phase)},
                        "minReplicas": low, "maxReplicas": max(low, high), "metrics": metrics[phase],
                        "behavior": {"scaleUp": _hpa_rules(behavior.scale_up),
                                     "scaleDown": _hpa_rules(behavior.scale_down)}}})
    return out


# ---------------------------------------------------------------------------------------------
# the whole set


def desired_replicas(spec: api.InferenceServiceSpec, decision: PlannedReplicas | None = None,
                     generation: int | None = None) -> dict[str, int | None]:
    """Replicas to apply per component; None means "leave to the HPA".

    This is the seam for the planner: its decision holds until the user edits the spec (a newer
    generation), whose replicas then win until the planner decides again. The bounds are applied
    here, whoever decided (a decision read back from an older operator's status included).
    """
    mode = spec.autoscaling.mode
    out: dict[str, int | None] = {"router": spec.router.replicas}
    for phase in api.PHASES:
        if mode == "HPA":
            out[phase] = None
            continue
        want = spec.phase(phase).replicas
        if mode == "Planner" and decision is not None and (
                generation is None or decision.generation is None or decision.generation >= generation):
            decided = decision.prefill if phase == "prefill" else decision.decode
            if decided is not None:
                low, high = spec.phase(phase).bounds()
                want = min(max(decided, low), high)
        out[phase] = want
    return out


def render(owner: Owner, spec: api.InferenceServiceSpec,
           replicas: Mapping[str, int | None] | None = None) -> list[dict[str, Any]]:
    """Every child object the InferenceService wants, in a safe apply order (RBAC before pods)."""
    replicas = replicas if replicas is not None else desired_replicas(spec)
    objs = router_rbac(owner) + services(owner, spec)
    objs += [deployment(owner, spec, c, replicas[c]) for c in api.COMPONENTS]
    objs += disruption_budgets(owner)
    if spec.network_policy.enabled:
        objs += network_policies(owner, spec)
    if spec.autoscaling.mode == "HPA":
        objs += autoscalers(owner, spec)
    return objs


def key(obj: Mapping[str, Any]) -> tuple[str, str]:
    """Identity of a child within its owner's namespace: (kind, name)."""
    return obj["kind"], obj["metadata"]["name"]
