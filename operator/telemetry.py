"""The operator's own Prometheus metrics: reconciles, the planner's decisions, and each
InferenceService's SLO as series the alert rules (charts/phasesplit/rules/phasesplit.rules.yaml)
and the dashboard join the runtime's histograms with.

One OperatorTelemetry per operator process (its own registry, so tests can run several); the kopf
handlers call it, and `serve` exports it on an HTTP port. Series are labelled by the
InferenceService's namespace and name and by its model (the runtime's `model` label), so a
Prometheus that scrapes the operator with honor_labels can join them to the runtime's series.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.utils import floatToGoString

from phasesplit.operator import api
from phasesplit.operator.planner import Decision, MetricsSnapshot
from phasesplit.runtime import metric_names as n

RECONCILE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SERVICE = ["namespace", "inferenceservice"]
_MODEL = [*_SERVICE, "model"]


def slo_bucket(target_s: float, buckets: tuple[float, ...]) -> str:
    """The `le` label of the largest histogram bucket at or below the target (the smallest bucket
    when the target is below them all): requests counted in it met the target."""
    within = [b for b in buckets if b <= target_s + 1e-12]
    return floatToGoString(within[-1] if within else buckets[0])


def direction(current: int, desired: int) -> str:
    return "up" if desired > current else "down" if desired < current else "hold"


class OperatorTelemetry:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.reconciles = Counter(n.OPERATOR_RECONCILES, "InferenceService reconciles",
                                  _SERVICE, registry=r)
        self.reconcile_errors = Counter(n.OPERATOR_RECONCILE_ERRORS,
                                        "InferenceService reconciles that failed (retried)", _SERVICE, registry=r)
        self.reconcile_seconds = Histogram(n.OPERATOR_RECONCILE_SECONDS,
                                           "Time one reconcile took", _SERVICE, buckets=RECONCILE_BUCKETS,
                                           registry=r)
        self.decisions = Counter(n.OPERATOR_PLANNER_DECISIONS,
                                 "Planner decisions by phase and direction (up, down, hold)",
                                 [*_MODEL, "phase", "direction"], registry=r)
        self.desired = Gauge(n.OPERATOR_PLANNER_DESIRED, "Replicas the planner last decided",
                             [*_MODEL, "phase"], registry=r)
        self.predicted = Gauge(n.OPERATOR_PLANNER_PREDICTED,
                               "The planner's predicted TTFT / ITL at the SLO percentile for its decision",
                               [*_MODEL, "slo"], registry=r)
        self.observed = Gauge(n.OPERATOR_PLANNER_OBSERVED,
                              "TTFT / ITL at the SLO percentile the planner measured in its window",
                              [*_MODEL, "slo"], registry=r)
        self.stale = Gauge(n.OPERATOR_PLANNER_STALE,
                           "1 when the planner's last step had no fresh metrics (it holds the replicas)",
                           _MODEL, registry=r)
        self.max_replicas = Gauge(n.OPERATOR_MAX_REPLICAS, "The spec's maxReplicas per phase",
                                  [*_MODEL, "phase"], registry=r)
        self.slo_target = Gauge(n.OPERATOR_SLO_TARGET, "The spec's TTFT / ITL target",
                                [*_MODEL, "slo"], registry=r)
        self.slo_budget = Gauge(n.OPERATOR_SLO_ERROR_BUDGET,
                                "Fraction of requests the SLO allows over target (1 - percentile)", _MODEL,
                                registry=r)
        self.slo_bucket = Gauge(n.OPERATOR_SLO_BUCKET,
                                "1 for the runtime histogram bucket (le) a request must land in to meet the target",
                                [*_MODEL, "slo", "le"], registry=r)
        self.deployments = Gauge(n.OPERATOR_DEPLOYMENT_INFO,
                                 "1 per child Deployment, naming its phase and model (for kube-state-metrics joins)",
                                 [*_MODEL, "phase", "deployment"], registry=r)
        # Per service: the labelled series it owns, removed when the spec moves them or it is deleted.
        self._series: dict[tuple[str, str], dict[str, set[tuple[Gauge | Counter, tuple[str, ...]]]]] = {}
        self._lock = threading.Lock()

    def _own(self, key: tuple[str, str], group: str, series: set[tuple[Gauge | Counter, tuple[str, ...]]]) -> None:
        """Record the series a service now has in `group`; drop the ones it no longer has."""
        with self._lock:
            groups = self._series.setdefault(key, {})
            for metric, labels in groups.get(group, set()) - series:
                with contextlib.suppress(KeyError):
                    metric.remove(*labels)
            groups[group] = series

    def observe_service(self, namespace: str, name: str, spec: api.InferenceServiceSpec) -> None:
        """The spec's SLO, bounds and children, as the rules and dashboard read them."""
        base = (namespace, name, spec.model.name)
        targets = {"ttft": (api.parse_duration(spec.slo.ttft), n.TTFT_BUCKETS),
                   "itl": (api.parse_duration(spec.slo.itl), n.ITL_BUCKETS)}
        series: set[tuple[Gauge | Counter, tuple[str, ...]]] = set()
        for slo, (target, buckets) in targets.items():
            self.slo_target.labels(*base, slo).set(target)
            series.add((self.slo_target, (*base, slo)))
            le = slo_bucket(target, buckets)
            self.slo_bucket.labels(*base, slo, le).set(1)
            series.add((self.slo_bucket, (*base, slo, le)))
        self.slo_budget.labels(*base).set(round(1 - spec.slo.percentile / 100, 6))
        series.add((self.slo_budget, base))
        for phase in api.PHASES:
            self.max_replicas.labels(*base, phase).set(spec.phase(phase).bounds()[1])
            series.add((self.max_replicas, (*base, phase)))
        for component in ("router", *api.PHASES):
            labels = (*base, component, f"{name}-{component}")
            self.deployments.labels(*labels).set(1)
            series.add((self.deployments, labels))
        self._own((namespace, name), "spec", series)

    def decided(self, namespace: str, name: str, model: str, decision: Decision,
                snapshot: MetricsSnapshot | None) -> None:
        """One planner step: its direction per phase, the replicas, predicted and observed latency."""
        base = (namespace, name, model)
        series: set[tuple[Gauge | Counter, tuple[str, ...]]] = set()
        for phase, d in (("prefill", decision.prefill), ("decode", decision.decode)):
            labels = (*base, phase, direction(d.current, d.desired))
            self.decisions.labels(*labels).inc()
            series.add((self.decisions, labels))
            self.desired.labels(*base, phase).set(d.desired)
            series.add((self.desired, (*base, phase)))
        self.stale.labels(*base).set(1 if decision.stale else 0)
        series.add((self.stale, base))
        observed = (snapshot.ttft_p, snapshot.itl_p) if snapshot is not None and not decision.stale else (None, None)
        for slo, predicted, seen in (("ttft", decision.predicted_ttft_s, observed[0]),
                                     ("itl", decision.predicted_itl_s, observed[1])):
            # A value the planner did not have this step is left out, not kept from an older one.
            for gauge, value in ((self.predicted, predicted), (self.observed, seen)):
                if value is not None:
                    gauge.labels(*base, slo).set(value)
                    series.add((gauge, (*base, slo)))
        # Decision counters stay (a counter that vanished would read as a reset); gauges follow the step.
        with self._lock:
            kept = self._series.get((namespace, name), {}).get("planner", set())
        self._own((namespace, name), "planner", series | {s for s in kept if s[0] is self.decisions})

    @contextlib.contextmanager
    def reconciling(self, namespace: str, name: str) -> Iterator[None]:
        """Count and time one reconcile; an exception counts as an error and propagates."""
        start = time.monotonic()
        self.reconcile_errors.labels(namespace, name)  # a zero to take increase() from
        try:
            yield
        except BaseException:
            self.reconcile_errors.labels(namespace, name).inc()
            raise
        finally:
            self.reconciles.labels(namespace, name).inc()
            self.reconcile_seconds.labels(namespace, name).observe(time.monotonic() - start)

    def forget(self, namespace: str, name: str) -> None:
        """The service was deleted: its series go (the reconcile counters too)."""
        with self._lock:
            groups = self._series.pop((namespace, name), {})
        for series in groups.values():
            for metric, labels in series:
                with contextlib.suppress(KeyError):
                    metric.remove(*labels)
        for metric in (self.reconciles, self.reconcile_errors, self.reconcile_seconds):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, name)

    def serve(self, port: int, address: str = "0.0.0.0") -> tuple[object, threading.Thread]:
        """Export /metrics on address:port in a daemon thread; returns the server and its thread."""
        return start_http_server(port, address, registry=self.registry)
