"""The InferenceService API (serving.phasesplit.io/v1alpha1): the one source of truth.

The CRD in crds/ is generated from these models (crdgen.py), so a rule lives in two forms next to
each other: a pydantic validator that the operator and the unit tests run, and the CEL rule
(`x-kubernetes-validations`) or OpenAPI keyword the API server enforces at `kubectl apply`. Keep
them side by side when editing; tests check both reject the same invalid specs.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in Python.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

from phasesplit.runtime import metric_names
from phasesplit.runtime.units import DURATION_PATTERN, parse_duration
from phasesplit.runtime.version import VERSION as PACKAGE_VERSION

GROUP = "serving.phasesplit.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["psvc"]

# Ports inside the pods. Fixed (not spec fields) because probes, Services and NetworkPolicies all
# refer to them; the KV port is configurable because it is part of the transfer contract.
HTTP_PORT = 8000
DEFAULT_KV_PORT = 9000
DEFAULT_RUNTIME_IMAGE = f"ghcr.io/phasesplit/runtime:{PACKAGE_VERSION}"

PHASES = ("prefill", "decode")
COMPONENTS = ("prefill", "decode", "router")

# RE2 (Kubernetes) and Python `re` must both accept these patterns: no lookarounds.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# What the runtime's --kv-cache-memory parser accepts (runtime/cli.py parse_bytes).
MEMORY_PATTERN = r"^[0-9]+(\.[0-9]+)?([kKmMgG]([iI])?([bB])?|[bB])?$"
RELATIVE_PATH_PATTERN = r"^[A-Za-z0-9._-][A-Za-z0-9._/-]*$"
URL_PATTERN = r"^https?://[^\s]+$"


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry; fieldPath makes the API server name the field."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def _quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not re.fullmatch(QUANTITY_PATTERN, value):
        raise ValueError(f"not a Kubernetes quantity: {value!r} (use e.g. 500m, 2Gi, 1)")
    return value


def _relative_path(text: str) -> str:
    if ".." in text:
        raise ValueError(f"path must not contain '..': {text!r}")
    return text


def _duration_type(minimum_s: float, cel_rule: str, message: str) -> Any:
    """A Go-style duration string checked alike by pydantic and the API server (CEL)."""
    def check(text: str) -> str:
        # parse_duration refuses zero and negatives; the minimum is the tighter bound where set.
        if parse_duration(text) < minimum_s:
            raise ValueError(f"{message}: {text!r}")
        return text
    return Annotated[
        str,
        Field(pattern=DURATION_PATTERN, max_length=32),
        AfterValidator(check),
        WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "maxLength": 32,
                        "x-kubernetes-validations": [cel(cel_rule, message)]}),
    ]


Duration = _duration_type(0, "duration(self) > duration('0s')", "must be a positive duration such as 500ms or 30s")
Interval = _duration_type(1, "duration(self) >= duration('1s')", "must be a duration of at least 1s, such as 30s")
Quantity = Annotated[
    int | str,
    AfterValidator(_quantity),
    WithJsonSchema({
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
    }),
]
RelativePath = Annotated[
    str,
    Field(pattern=RELATIVE_PATH_PATTERN, max_length=1024),
    AfterValidator(_relative_path),
    WithJsonSchema({
        "type": "string", "pattern": RELATIVE_PATH_PATTERN, "maxLength": 1024,
        "x-kubernetes-validations": [cel("!self.contains('..')", "must not contain '..'")],
    }),
]
# CEL rules also run against each `default:` as written (before nested defaults are filled in), so
# a rule must guard every field it reads with has().

# Kubernetes types too large to mirror field by field: stored as given and validated by the API
# server when the operator copies them into pod templates.
FreeObject = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
Port = Annotated[int, Field(ge=1, le=65535)]


class ApiModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def wire(self) -> dict[str, Any]:
        """The object as it appears in Kubernetes (camelCase, unset fields left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def defaults_to_empty_object() -> dict[str, Any]:
    # The API server fills nested defaults only inside objects that exist; `default: {}` on a
    # sub-object makes `kubectl get -o yaml` show every effective value of the minimal spec.
    return {"default": {}}


def section(model: type[BaseModel], description: str) -> Any:
    """A sub-object field that defaults to the model's defaults, in pydantic and in the CRD alike."""
    return Field(default_factory=model, json_schema_extra=defaults_to_empty_object(), description=description)


# ---------------------------------------------------------------------------------------------
# model


class PVCSource(ApiModel):
    """A model stored on a PersistentVolumeClaim, mounted read-only at /models."""

    claim_name: str = Field(description="Name of the PersistentVolumeClaim in the InferenceService's namespace.",
                            min_length=1, max_length=253)
    path: RelativePath | None = Field(None, description="Path inside the volume of the .gguf file or Hugging Face "
                                                        "directory (relative; default: the volume's root).")


class HostPathSource(ApiModel):
    """A model on every node's filesystem, mounted read-only at /models."""

    directory: str = Field(description="Absolute directory on the node that holds the model.",
                           pattern=r"^/", max_length=1024)
    path: RelativePath | None = Field(None, description="Path inside the directory of the .gguf file or Hugging "
                                                        "Face directory (relative; default: the directory itself).")


class ModelCacheSpec(ApiModel):
    """Where the runtime keeps what it derives from the model (a GGUF converted to safetensors, the
    weights fused for the serving dtype), keyed by the model's content: exactly one of hostPath,
    claimName. The first pod fills it and the pods after it (restarts, rollouts, scale-ups) read it
    instead of converting again. Without it each pod converts into its own emptyDir at every start."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "(has(self.hostPath) ? 1 : 0) + (has(self.claimName) ? 1 : 0) == 1",
        "spec.model.cache: set exactly one of hostPath or claimName")]})

    host_path: str | None = Field(
        None, description="A directory on the node, shared by the pods on that node and kept across pod restarts "
                          "(created if missing; it must be writable by the runtime's uid 1000, or each pod falls "
                          "back to converting into its own emptyDir).", pattern=r"^/", max_length=1024)
    claim_name: str | None = Field(
        None, description="A PersistentVolumeClaim in the InferenceService's namespace (ReadWriteMany: one "
                          "conversion for every node).", min_length=1, max_length=253)

    @model_validator(mode="after")
    def _one_place(self) -> ModelCacheSpec:
        if (self.host_path is None) == (self.claim_name is None):
            raise ValueError("spec.model.cache: set exactly one of hostPath or claimName")
        return self


class ModelSpec(ApiModel):
    """What model to serve and where its weights come from: exactly one of builtin, pvc, hostPath."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "(has(self.builtin) ? 1 : 0) + (has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) == 1",
        "spec.model: set exactly one model source: builtin, pvc or hostPath")]})

    name: str = Field(description="Served model name: what clients pass as `model` in the OpenAI API.",
                      min_length=1, max_length=128)
    builtin: Literal["smollm2"] | None = Field(
        None, description="A model bundled in the runtime image: `smollm2` (SmolLM2-135M-Instruct).")
    pvc: PVCSource | None = Field(None, description="Load the model from a PersistentVolumeClaim.")
    host_path: HostPathSource | None = Field(None, description="Load the model from a directory on the node.")
    cache: ModelCacheSpec | None = Field(
        None, description="A cache of the converted model that outlives pods (default: none; each pod converts "
                          "into its own emptyDir at every start).")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        count = sum(x is not None for x in (self.builtin, self.pvc, self.host_path))
        if count != 1:
            raise ValueError("spec.model: set exactly one model source: builtin, pvc or hostPath")
        return self


# ---------------------------------------------------------------------------------------------
# runtime and pods


class EnvVar(ApiModel):
    """An environment variable for the runtime container (core/v1 EnvVar)."""

    name: str = Field(description="Variable name.", min_length=1, max_length=256)
    value: str | None = Field(None, description="Literal value.")
    value_from: FreeObject | None = Field(
        None, description="Source of the value (core/v1 EnvVarSource: secretKeyRef, configMapKeyRef, fieldRef, ...).")


class LocalObjectReference(ApiModel):
    """A reference to an object in the same namespace."""

    name: str = Field(description="Name of the referenced object.", min_length=1, max_length=253)


class RuntimeSpec(ApiModel):
    """The runtime container shared by the prefill, decode and router pods."""

    image: str = Field(DEFAULT_RUNTIME_IMAGE, description="Runtime container image.", min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="When the kubelet pulls the image.")
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, description="Secrets with registry credentials for the image.", max_length=16)
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Device the model runs on (auto: CUDA when a GPU is visible).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype (auto: bfloat16 on CUDA and on CPUs with AVX512-BF16, "
                               "float32 on other CPUs).")
    max_model_len: int | None = Field(None, description="Context length limit in tokens (default: the model's).",
                                      ge=16, le=1048576)
    block_size: int = Field(16, description="Tokens per KV cache block.", ge=1, le=1024)
    kv_cache_memory: str | None = Field(
        None, description="Memory for the KV cache per worker (per tensor-parallel rank), e.g. 2GiB (default: a "
                          "fraction of free memory).",
        pattern=MEMORY_PATTERN, max_length=32)
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.", max_length=64)
    args: list[str] = Field(default_factory=list, description="Extra arguments appended to `phasesplit serve` in "
                                                             "every pod.", max_length=64)


class ResourceRequirements(ApiModel):
    """Compute resources of a container (core/v1 ResourceRequirements); GPUs as `nvidia.com/gpu`."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.requests) || !('nvidia.com/gpu' in self.requests) || "
        "(has(self.limits) && 'nvidia.com/gpu' in self.limits)",
        "nvidia.com/gpu must be set in limits (GPUs cannot be overcommitted)", ".limits")]})

    limits: dict[str, Quantity] | None = Field(None, description="Most of each resource the container may use.")
    requests: dict[str, Quantity] | None = Field(None, description="Resources reserved for the container.")

    @model_validator(mode="after")
    def _gpu_in_limits(self) -> ResourceRequirements:
        if self.requests and "nvidia.com/gpu" in self.requests and "nvidia.com/gpu" not in (self.limits or {}):
            raise ValueError("nvidia.com/gpu must be set in limits (GPUs cannot be overcommitted)")
        return self


class Toleration(ApiModel):
    """Lets the pods schedule onto nodes with a matching taint (core/v1 Toleration)."""

    key: str | None = Field(None, description="Taint key to match; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal (default Equal).")
    value: str | None = Field(None, description="Taint value to match with operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all.")
    toleration_seconds: int | None = Field(None, description="How long a NoExecute taint is tolerated.")


class Placement(ApiModel):
    """Where and how big the pods of one component are."""

    resources: ResourceRequirements = section(ResourceRequirements, "Container resources; request GPUs as `nvidia.com/gpu` limits.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the pods tolerate.",
                                          max_length=32)
    affinity: FreeObject | None = Field(None, description="Pod affinity rules (core/v1 Affinity).")


GPU = "nvidia.com/gpu"
_REPLICA_RULES = [
    # Quantities are int-or-string: compared as strings ("2" and 2 alike).
    cel("!has(self.tensorParallelSize) || self.tensorParallelSize == 1 || !has(self.resources.limits) || "
        "!('nvidia.com/gpu' in self.resources.limits) || "
        "string(self.resources.limits['nvidia.com/gpu']) == string(self.tensorParallelSize)",
        "nvidia.com/gpu must equal tensorParallelSize (one GPU per rank)", ".resources.limits"),
    cel("!has(self.minReplicas) || self.minReplicas <= self.replicas",
        "minReplicas must be less than or equal to replicas", ".minReplicas"),
    cel("!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
        "replicas must be less than or equal to maxReplicas", ".replicas"),
    cel("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
        "minReplicas must be less than or equal to maxReplicas", ".maxReplicas"),
]


class PhaseSpec(Placement):
    """One phase's worker pool: its size, placement and batching limits."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _REPLICA_RULES})

    replicas: int = Field(1, description="Worker pods to start with; the autoscaler moves it within "
                                         "[minReplicas, maxReplicas].", ge=0, le=1000)
    min_replicas: int | None = Field(None, description="Fewest workers the autoscaler may run "
                                                      "(default: min(1, replicas)).", ge=0, le=1000)
    max_replicas: int | None = Field(None, description="Most workers the autoscaler may run "
                                                      "(default: max(replicas, 4)).", ge=0, le=1000)
    max_num_seqs: int | None = Field(None, description="Most requests in one worker's running batch.",
                                     ge=1, le=65536)
    max_num_batched_tokens: int | None = Field(
        None, description="Token budget of one engine step (prefill chunks are cut to fit).", ge=1, le=1048576)
    tensor_parallel_size: int = Field(
        1, description="Tensor-parallel ranks per worker pod (one process each; `--tensor-parallel-size`). "
                       "With device cuda each pod gets this many `nvidia.com/gpu`; the model must split into "
                       "that many parts (runtime docs/engine.md).", ge=1, le=64)

    @model_validator(mode="after")
    def _gpus_per_rank(self) -> PhaseSpec:
        gpus = (self.resources.limits or {}).get(GPU)
        if self.tensor_parallel_size > 1 and gpus is not None and str(gpus) != str(self.tensor_parallel_size):
            raise ValueError(f"nvidia.com/gpu must equal tensorParallelSize (one GPU per rank): limits give "
                             f"{gpus}, tensorParallelSize is {self.tensor_parallel_size}")
        return self

    @model_validator(mode="after")
    def _replica_bounds(self) -> PhaseSpec:
        if self.min_replicas is not None and self.min_replicas > self.replicas:
            raise ValueError("minReplicas must be less than or equal to replicas")
        if self.max_replicas is not None and self.replicas > self.max_replicas:
            raise ValueError("replicas must be less than or equal to maxReplicas")
        if None not in (self.min_replicas, self.max_replicas) and self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must be less than or equal to maxReplicas")
        return self

    def bounds(self) -> tuple[int, int]:
        """The effective [min, max] replicas, defaults filled in."""
        low = self.min_replicas if self.min_replicas is not None else min(1, self.replicas)
        high = self.max_replicas if self.max_replicas is not None else max(self.replicas, 4)
        return low, max(low, high)


class PrefillSpec(PhaseSpec):
    """The prefill pool: builds the prompt's KV cache and sends it to a decode worker (decides TTFT)."""


class DecodeSpec(PhaseSpec):
    """The decode pool: owns each request and generates its tokens (decides ITL)."""

    local_prefill_threshold: int = Field(
        0, description="Prompts with at most this many uncached tokens are prefilled on the decode worker "
                       "itself (0: always remote).", ge=0, le=1048576)
    prefill_placement: Literal["Static", "Adaptive"] = Field(
        "Static", description="Where a prompt is prefilled. Static: on a prefill worker unless within "
                              "localPrefillThreshold. Adaptive: on the decode worker where its measured step costs "
                              "say the first token comes sooner and no decode step would outgrow slo.itl, else on a "
                              "prefill worker (localPrefillThreshold still forces short prompts local); and the "
                              "router sends a whole request to a prefill worker with nothing to prefill that carries "
                              "two requests fewer than the decode worker while that worker's steps near slo.itl (40 % of "
                              "it), so every core decodes a decode-heavy mix.")


class SecretKeyRef(ApiModel):
    """A key of a Secret in the InferenceService's namespace."""

    name: str = Field(description="Secret name.", min_length=1, max_length=253)
    key: str = Field("api-key", description="Key in the Secret whose value is the API key.", min_length=1)


class RouterServiceSpec(ApiModel):
    """The Service in front of the router pods: the endpoint clients call."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", description="Service type.")
    port: Port = Field(80, description="Service port clients connect to.")
    annotations: dict[str, str] = Field(default_factory=dict,
                                        description="Annotations for the Service (e.g. load balancer settings).")


class RouterSpec(Placement):
    """The router: OpenAI-compatible front end that picks a decode and a prefill worker per request."""

    replicas: int = Field(1, description="Router pods.", ge=1, le=1000)
    service: RouterServiceSpec = section(RouterServiceSpec, "How the router is exposed.")
    api_key_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret holding the API key clients must send as a Bearer token (unset: no auth).")


# ---------------------------------------------------------------------------------------------
# SLO and autoscaling


class SLOSpec(ApiModel):
    """Latency targets the autoscaler sizes the pools for."""

    ttft: Duration = Field("500ms", description="Time-to-first-token target (prefill pool), e.g. 500ms.")
    itl: Duration = Field("50ms", description="Inter-token latency target (decode pool), e.g. 50ms.")
    percentile: float = Field(90, description="Percentile of requests that must meet the targets, e.g. 90.",
                              ge=1, le=99.99)


class RatioBounds(ApiModel):
    """Bounds on prefill replicas divided by decode replicas, kept by the autoscaler."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.min) || !has(self.max) || self.min <= self.max",
        "ratio.min must be less than or equal to ratio.max", ".min")]})

    min: float | None = Field(None, description="Lowest prefill:decode replica ratio, e.g. 0.25.", ge=0, le=100)
    max: float | None = Field(None, description="Highest prefill:decode replica ratio, e.g. 4.", ge=0, le=100)

    @model_validator(mode="after")
    def _ordered(self) -> RatioBounds:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError("ratio.min must be less than or equal to ratio.max")
        return self


class ScalingPolicy(ApiModel):
    """A limit on how fast replicas change (as in autoscaling/v2 HPAScalingPolicy)."""

    type: Literal["Pods", "Percent"] = Field(description="Pods: an absolute count; Percent: of current replicas.")
    value: int = Field(description="Pods or percent allowed to change within one period.", ge=1, le=100000)
    period_seconds: int = Field(description="Window the limit applies to, in seconds.", ge=1, le=1800)


class ScalingRules(ApiModel):
    """How one direction of scaling is damped (as in autoscaling/v2 HPAScalingRules)."""

    stabilization_window_seconds: int = Field(
        0, description="Use the most conservative recommendation of this many past seconds.", ge=0, le=3600)
    select_policy: Literal["Max", "Min", "Disabled"] = Field(
        "Max", description="Which policy wins when several apply; Disabled forbids this direction.")
    policies: list[ScalingPolicy] = Field(default_factory=list, max_length=10,
                                          description="Rate limits (none: unlimited, or the HPA defaults in "
                                                      "HPA mode).")


class ScaleDownRules(ScalingRules):
    """Damping of scale-down; waits 5 minutes by default so a dip does not drop warm workers."""

    stabilization_window_seconds: int = Field(
        300, description="Use the most conservative recommendation of this many past seconds.", ge=0, le=3600)


class Behavior(ApiModel):
    """Scale-up and scale-down damping, per phase pool."""

    scale_up: ScalingRules = section(ScalingRules, "Rules for adding replicas.")
    scale_down: ScaleDownRules = section(ScaleDownRules, "Rules for removing replicas.")


class MetricsSource(ApiModel):
    """Where the autoscaler reads TTFT, ITL and queue metrics."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.source) || self.source != 'prometheus' || has(self.url)",
        "metrics.url is required when metrics.source is prometheus", ".url")]})

    source: Literal["pods", "prometheus"] = Field(
        "pods", description="pods: scrape each pod's /metrics; prometheus: query the Prometheus at url.")
    url: str | None = Field(None, description="Prometheus base URL, e.g. http://prometheus.monitoring:9090.",
                            pattern=URL_PATTERN, max_length=2048)

    @model_validator(mode="after")
    def _url_for_prometheus(self) -> MetricsSource:
        if self.source == "prometheus" and not self.url:
            raise ValueError("metrics.url is required when metrics.source is prometheus")
        return self


class HPATargets(ApiModel):
    """Per-pod metric targets of the HorizontalPodAutoscalers rendered in HPA mode."""

    prefill_queue_tokens: int = Field(
        2048, description=f"Target average {metric_names.PREFILL_QUEUE_TOKENS} per prefill pod.", ge=1)
    decode_requests_waiting: int = Field(
        4, description=f"Target average {metric_names.WAITING} per decode pod.", ge=1)
    decode_kv_cache_usage: float = Field(
        0.8, description=f"Target average {metric_names.KV_USAGE} (0-1) per decode pod.", gt=0, le=1)


class ScaleToZeroSpec(ApiModel):
    """Scale to zero (Planner mode): a phase with minReplicas 0 goes to zero when idle; the router
    (always running) holds the requests that then arrive and the planner brings the phases back."""

    idle_after: Duration = Field(description="How long a phase must see nothing arriving, held, queued or "
                                             "running before it goes to zero, e.g. 5m.")
    hold_timeout: Duration = Field("120s", description="How long the router holds a request that finds no "
                                                       "worker before answering 503 with Retry-After, e.g. 120s.")
    max_held: int = Field(256, description="Requests the router holds at once; more are answered 429 with "
                                           "Retry-After at once.",
                          ge=1, le=100000)


_ZERO_RULE_MESSAGE = "minReplicas 0 needs autoscaling.scaleToZero.idleAfter (Planner mode)"


def _zero_rule(phase: str) -> dict[str, str]:
    # CEL rules also run against defaults as written, so every field read is guarded by has().
    return cel(f"!has(self.{phase}) || !has(self.{phase}.minReplicas) || self.{phase}.minReplicas > 0 || "
               "(has(self.autoscaling) && (has(self.autoscaling.scaleToZero) || "
               "(has(self.autoscaling.mode) && self.autoscaling.mode != 'Planner')))",
               f"{phase}.{_ZERO_RULE_MESSAGE}", f".{phase}.minReplicas")


class AutoscalingSpec(ApiModel):
    """How the prefill and decode pools are sized."""

    mode: Literal["Planner", "HPA", "Disabled"] = Field(
        "Planner", description="Planner: the operator sizes both pools jointly from the SLO; HPA: one "
                               "HorizontalPodAutoscaler per pool on queue metrics; Disabled: replicas as written.")
    interval: Interval = Field("30s", description="How often the planner decides, e.g. 30s.")
    ratio: RatioBounds | None = Field(None, description="Bounds on the prefill:decode replica ratio.")
    behavior: Behavior = section(Behavior, "Scale-up and scale-down damping (as in autoscaling/v2).")
    metrics: MetricsSource = section(MetricsSource, "Where metrics come from.")
    hpa_targets: HPATargets = section(HPATargets, "Metric targets used in HPA mode.")
    scale_to_zero: ScaleToZeroSpec | None = Field(
        None, description="Planner mode: let phases with minReplicas 0 go to zero when idle (the router holds "
                          "requests until they are back). An HPA cannot scale to zero without the alpha "
                          "HPAScaleToZero gate: in HPA mode minReplicas 0 is rendered as 1.")


class KVTransferSpec(ApiModel):
    """How KV caches move from prefill to decode workers, and what happens when that fails."""

    port: Port = Field(DEFAULT_KV_PORT, description="TCP port on decode pods that receives KV blocks.")
    failure_policy: Literal["Retry", "Local", "Fail", "RetryLocal"] = Field(
        "RetryLocal", description="When a prefill worker fails or times out: Retry another prefill worker, "
                                  "prefill Local(ly) on the decode worker, Fail the request, or RetryLocal "
                                  "(retry once, then locally).")
    timeout: Duration = Field("30s", description="How long a decode worker waits for a remote prefill, e.g. 30s.")


class NetworkPolicySpec(ApiModel):
    """The NetworkPolicies that fence the worker pods."""

    enabled: bool = Field(True, description="Render NetworkPolicies that admit only router->workers, "
                                            "decode->prefill and prefill->decode (KV port) traffic, plus "
                                            "metric scrapes by the operator.")
    operator_namespace: str = Field(
        "phasesplit-system", min_length=1, max_length=63,
        description="Namespace the operator runs in: only its pods there may scrape the workers "
                    "(the policy's operator rule selects that namespace by its kubernetes.io/metadata.name).")


class InferenceServiceSpec(ApiModel):
    """Desired state of a phase-split model deployment: a router, a prefill pool and a decode pool."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        f"!has(self.kvTransfer) || !has(self.kvTransfer.port) || self.kvTransfer.port != {HTTP_PORT}",
        f"kvTransfer.port must differ from the runtime's HTTP port {HTTP_PORT}", ".kvTransfer.port"),
        _zero_rule("prefill"), _zero_rule("decode")]})

    model: ModelSpec = Field(description="The model to serve.")
    runtime: RuntimeSpec = section(RuntimeSpec, "Runtime image and engine settings shared by all pods.")
    prefill: PrefillSpec = section(PrefillSpec, "The prefill worker pool.")
    decode: DecodeSpec = section(DecodeSpec, "The decode worker pool.")
    router: RouterSpec = section(RouterSpec, "The router (OpenAI-compatible front end).")
    slo: SLOSpec = section(SLOSpec, "Latency targets.")
    autoscaling: AutoscalingSpec = section(AutoscalingSpec, "How the pools are sized.")
    kv_transfer: KVTransferSpec = section(KVTransferSpec, "KV cache transfer between the pools.")
    network_policy: NetworkPolicySpec = section(NetworkPolicySpec, "Network isolation of the worker pods.")
    drain_timeout: Duration = Field(
        "5m", description="How long a pod being deleted (scale-down, rollout) may take to finish the requests "
                          "it holds: its generations stream to the end, its prefills and KV sends complete. "
                          "Sets the pods' termination grace period (plus the preStop delay and a margin).")

    @model_validator(mode="after")
    def _kv_port_free(self) -> InferenceServiceSpec:
        if self.kv_transfer.port == HTTP_PORT:
            raise ValueError(f"kvTransfer.port must differ from the runtime's HTTP port {HTTP_PORT}")
        return self

    @model_validator(mode="after")
    def _zero_needs_scale_to_zero(self) -> InferenceServiceSpec:
        a = self.autoscaling
        if a.mode == "Planner" and a.scale_to_zero is None:
            for name in PHASES:
                if self.phase(name).min_replicas == 0:
                    raise ValueError(f"{name}.{_ZERO_RULE_MESSAGE}")
        return self

    def phase(self, name: str) -> PhaseSpec:
        return {"prefill": self.prefill, "decode": self.decode}[name]


# ---------------------------------------------------------------------------------------------
# status


class Condition(ApiModel):
    """One aspect of the service's state (metav1.Condition)."""

    type: str = Field(description="Ready, PrefillReady, DecodeReady or RouterReady.")
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: str = Field(description="CamelCase reason for the status.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(None, description="Spec generation the condition was computed for.")


class PhaseStatus(ApiModel):
    """Observed size of one component's Deployment."""

    replicas: int = Field(0, description="Pods that exist.")
    ready_replicas: int = Field(0, description="Pods that pass their readiness probe.")
    desired_replicas: int = Field(0, description="Pods wanted now (by the spec, the planner or the HPA).")
    summary: str = Field("0/0", description="ready/desired, for `kubectl get`.")
    startup_seconds: float | None = Field(
        None, description="Measured start-up of this phase's pods, creation to Ready: the median of the last "
                          "few (prefill and decode). The planner takes it as its reaction time.")


class DecisionStatus(ApiModel):
    """The autoscaler's latest decision, as recorded in the status."""

    time: str | None = Field(None, description="When it was made (RFC 3339).")
    reason: str | None = Field(None, description="Why, in words (which metric or SLO drove it).")
    prefill_replicas: int | None = Field(None, description="Prefill replicas decided.")
    decode_replicas: int | None = Field(None, description="Decode replicas decided.")
    generation: int | None = Field(None, description="Spec generation the decision was made under; a newer spec "
                                                     "(a hand edit of replicas) wins until the next decision.")


class Observed(ApiModel):
    """What the autoscaler last measured, over its interval."""

    ttft_seconds: float | None = Field(None, description="TTFT at the SLO percentile, seconds.")
    itl_seconds: float | None = Field(None, description="ITL at the SLO percentile, seconds.")
    request_rate: float | None = Field(None, description="Requests per second arriving.")
    attainment: float | None = Field(None, description="Fraction of requests that met both SLO targets (0-1).")


class AutoscalingStatus(ApiModel):
    """State of the autoscaler (written by the planner)."""

    mode: str | None = Field(None, description="Mode in effect.")
    last_decision: DecisionStatus | None = Field(None, description="The latest decision.")
    observed: Observed | None = Field(None, description="Latest measurements.")
    conditions: list[Condition] = Field(default_factory=list,
                                        description="MetricsAvailable: whether the last step had fresh metrics "
                                                    "(False holds the replicas); SLOReachable when False: "
                                                    "prompts too long for the TTFT target at any size; "
                                                    "ScaledToZero: True while phases are at zero (Idle), "
                                                    "False with reason Woken when held requests woke them.")


class InferenceServiceStatus(ApiModel):
    """Observed state, computed from the child objects."""

    observed_generation: int | None = Field(None, description="Spec generation last reconciled.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, PrefillReady, DecodeReady, "
                                                                          "RouterReady.")
    prefill: PhaseStatus | None = Field(None, description="The prefill Deployment.")
    decode: PhaseStatus | None = Field(None, description="The decode Deployment.")
    router: PhaseStatus | None = Field(None, description="The router Deployment.")
    endpoint: str | None = Field(None, description="URL of the router Service inside the cluster.")
    autoscaling: AutoscalingStatus | None = Field(None, description="Autoscaler state.")
