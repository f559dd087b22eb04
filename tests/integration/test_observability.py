"""Observability out of the box (issue 20): the dashboard and the alert rules against the real
Prometheus (Debian's package) scraping a live split stack (router, prefill and decode processes)
under a short `phasesplit bench` load, plus the operator's metrics endpoint, fed by the real
planner reading that Prometheus.

- every panel query and every rule expression parses, and every panel returns data with the
  dashboard's variables substituted (except the EXEMPT panels, which only parse);
- the chart renders the PrometheusRule from the one rules file, and promtool accepts it;
- with the TTFT target below what this machine can do, the TTFT burn alert's expression returns a
  series, and with a generous target it returns none.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from phasesplit.operator import api
from phasesplit.operator.metrics.autoscale import ServiceAutoscaler
from phasesplit.operator.telemetry import OperatorTelemetry
from tests.integration.test_metrics_prometheus import SCRAPE_S, running_prometheus
from tests.integration.test_split import MODEL, start_split
from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "phasesplit"
DASHBOARD = CHART / "dashboards" / "phasesplit.json"
RULES = CHART / "rules" / "phasesplit.rules.yaml"
NAMESPACE, SERVICE = "obs-test", "chat"
RATE_INTERVAL = "2m"  # $__rate_interval: wider than the whole load, so every rate() sees all of it
# Panels whose data cannot exist without a cluster: they must parse here, and
# tests/cluster/test_operator.py::test_dashboard_cluster_panels_return_data checks that each
# returns data from kube-state-metrics and a live operator on the real control plane.
EXEMPT = {
    "Replicas: desired vs ready": "kube-state-metrics reads the Deployments from a Kubernetes API server; "
                                  "this test runs the processes without one",
    "Reconciles / s": "reconciles run in the kopf handlers against an API server",
    "Reconcile duration": "as Reconciles / s",
}
MONITORING_KINDS = ["monitoring.coreos.com/v1/PodMonitor", "monitoring.coreos.com/v1/ServiceMonitor",
                    "monitoring.coreos.com/v1/PrometheusRule"]


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["refId"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def substitute(expr: str, namespace: str = NAMESPACE, model: str = MODEL) -> str:
    """The dashboard's variables as Grafana would fill them for this stack."""
    out = (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", namespace)
           .replace("$model", model))
    assert "$" not in out, f"a dashboard variable this test does not know: {expr}"
    return out


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def query(prom: str, promql: str) -> dict:
    r = httpx.get(prom + "/api/v1/query", params={"query": promql}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{promql}\n-> {r.status_code} {body}"
    return body["data"]


def finite(data: dict) -> list[tuple[dict, float]]:
    """(labels, value) of each series' finite values: an instant query's, or a range query's points."""
    out = []
    for s in data["result"]:
        for _, v in s.get("values") or [s["value"]]:
            if math.isfinite(float(v)):
                out.append((s["metric"], float(v)))
    return out


def query_range(prom: str, promql: str, start: float, end: float) -> dict:
    """What a dashboard panel draws over [start, end]."""
    r = httpx.get(prom + "/api/v1/query_range",
                  params={"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "2s"}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{promql}\n-> {r.status_code} {body}"
    return body["data"]


def service_spec(ttft: str, prometheus: str = "http://127.0.0.1:9090") -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({
        "model": {"builtin": "smollm2", "name": MODEL},
        "slo": {"ttft": ttft, "itl": "10s", "percentile": 90},
        "prefill": {"replicas": 1, "maxReplicas": 2}, "decode": {"replicas": 1, "maxReplicas": 2},
        "autoscaling": {"interval": "10s", "metrics": {"source": "prometheus", "url": prometheus}}})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    procs = start_split(tmp_path_factory.mktemp("obs-split"))
    yield dict(zip(("prefill", "decode", "router"), procs, strict=True))
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def telemetry():
    t = OperatorTelemetry()
    port = free_port()
    server, thread = t.serve(port, "127.0.0.1")
    yield t, f"127.0.0.1:{port}"
    server.shutdown()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def prometheus(stack, telemetry, tmp_path_factory):
    # Labels as the chart's PodMonitor gives them (namespace and pod from discovery, the
    # InferenceService from the pod's label); the operator's own namespace labels are kept, as the
    # ServiceMonitor's honorLabels keeps them.
    runtime = [{"targets": [p.url.removeprefix("http://")],
                "labels": {"namespace": NAMESPACE, "inferenceservice": SERVICE, "pod": f"{SERVICE}-{role}-0"}}
               for role, p in stack.items()]
    jobs = [{"job_name": "phasesplit-runtime", "static_configs": runtime},
            {"job_name": "phasesplit-operator", "honor_labels": True, "static_configs": [{"targets": [telemetry[1]]}]}]
    with running_prometheus([], tmp_path_factory.mktemp("obs-prometheus"), jobs, [RULES]) as url:
        yield url


@pytest.fixture(scope="module")
def loaded(stack, telemetry, prometheus, tmp_path_factory):
    """Prometheus after a short bench load, with the planner stepping on what it scraped."""
    t, _ = telemetry
    spec = service_spec("1ms", prometheus)  # below what any machine can do
    t.observe_service(NAMESPACE, SERVICE, spec)  # as the reconcile does
    deadline = time.monotonic() + 60
    while len(finite(query(prometheus, "up == 1"))) < 4:
        assert time.monotonic() < deadline, f"prometheus did not scrape all four targets: {query(prometheus, 'up')}"
        time.sleep(0.5)
    time.sleep(2 * SCRAPE_S)  # a sample before the load, for rate()
    start = time.time()
    out = tmp_path_factory.mktemp("obs-bench") / "bench.json"
    bench = subprocess.Popen(
        [sys.executable, "-m", "phasesplit.runtime.cli", "bench", "--no-progress", "--url", stack["router"].url,
         "--input-len", "64", "--output-len", "8", "--num-prompts", "12", "--request-rate", "1",
         "--warmup", "1", "--output-json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    scaler = ServiceAutoscaler(spec)
    current = {"prefill": 1, "decode": 1}
    steps = []

    def step() -> None:
        result = asyncio.run(scaler.step(current, {}, time.time()))  # as the operator's planner loop does
        assert not result.errors, result.errors
        t.decided(NAMESPACE, SERVICE, MODEL, result.decision, result.snapshot)
        steps.append(result.decision)

    try:
        while bench.poll() is None:
            time.sleep(8)
            step()
        printed = bench.stdout.read()
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 0, printed
    print(printed[-1500:])
    step()
    time.sleep(3 * SCRAPE_S)  # the last samples and a rule evaluation after them
    print("planner steps:", [(d.prefill.desired, d.decode.desired, d.stale, d.predicted_ttft_s) for d in steps])
    return {"prometheus": prometheus, "telemetry": t, "steps": steps, "window": (start, time.time())}


def test_exemptions_are_the_panels_without_runtime_data():
    titles = {title for title, _, _ in panel_queries()}
    assert set(EXEMPT) <= titles, "an exempt panel is no longer on the dashboard"
    needs_cluster = {title for title, _, expr in panel_queries() if "kube_" in expr or "reconcile" in expr}
    assert needs_cluster == set(EXEMPT)


@pytest.mark.slow
def test_every_panel_query_parses_and_returns_data(loaded):
    prom = loaded["prometheus"]
    empty = []
    for title, ref, expr in panel_queries():
        # As the panel draws it: over the time of the load (asserts it parsed and evaluated).
        data = query_range(prom, substitute(expr), *loaded["window"])
        values = finite(data)
        shown = (f"{len(data['result'])} series, {len(values)} points, last {values[-1][1]:.4g}" if values
                 else "no data")
        print(f"{title[:44]:44} {ref}  {shown}{'  (exempt: parses)' if title in EXEMPT else ''}")
        if title not in EXEMPT and not values:
            empty.append(f"{title} [{ref}]: {substitute(expr)}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


@pytest.mark.slow
def test_every_rule_parses_and_evaluates_cleanly(loaded):
    prom = loaded["prometheus"]
    for rule in rules():
        query(prom, rule["expr"])
    loaded_rules = [r for g in httpx.get(prom + "/api/v1/rules", timeout=10).json()["data"]["groups"]
                    for r in g["rules"]]
    assert len(loaded_rules) == len(rules())
    bad = [(r["name"], r.get("lastError")) for r in loaded_rules if r["health"] != "ok"]
    assert not bad, bad
    # The recording rules the dashboard and alerts read produced series for this stack.
    for rule in rules():
        if "record" in rule:
            assert finite(query(prom, rule["record"])), f"{rule['record']} recorded nothing"


@pytest.mark.slow
def test_ttft_burn_alert_fires_when_the_slo_is_below_capacity(loaded):
    prom, t = loaded["prometheus"], loaded["telemetry"]
    alerts = {r["alert"]: r["expr"] for r in rules() if "alert" in r}
    fired = finite(query(prom, alerts["PhasesplitTTFTBudgetBurnFast"]))
    print("TTFT fast burn with a 1ms target:", fired)
    assert [(m["namespace"], m["model"]) for m, _ in fired] == [(NAMESPACE, MODEL)]
    assert fired[0][1] > 2 * 0.1  # over twice the 10 % a p90 target allows
    assert finite(query(prom, alerts["PhasesplitTTFTBudgetBurnSlow"]))
    # ITL's target (10 s) is generous: its alert stays quiet on the same traffic.
    assert not finite(query(prom, alerts["PhasesplitITLBudgetBurnFast"]))
    # A target the machine meets: the same expression goes quiet once the operator says so.
    t.observe_service(NAMESPACE, SERVICE, service_spec("60s", prom))
    deadline = time.monotonic() + 30
    while finite(query(prom, alerts["PhasesplitTTFTBudgetBurnFast"])):
        assert time.monotonic() < deadline, "the TTFT burn alert kept firing with a 60 s target"
        time.sleep(SCRAPE_S)


def helm_binary() -> str:
    cache = Path(os.environ.get("PHASESPLIT_CACHE", Path.home() / ".cache" / "phasesplit"))
    found = os.environ.get("HELM") or shutil.which("helm") or next(iter(sorted(cache.glob("kube/*/bin/helm"))[-1:]), None)
    assert found, "helm is missing: run hack/setup.sh (hack/setup.d/50-kube-tools.sh builds it)"
    return str(found)


def helm_template(*args: str) -> list[dict]:
    out = subprocess.run([helm_binary(), "template", "obs", str(CHART), "--namespace", "monitoring", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_chart_renders_the_rules_promtool_checks(tmp_path):
    api_versions = [a for kind in MONITORING_KINDS for a in ("--api-versions", kind)]
    docs = helm_template("-f", str(CHART / "ci" / "monitoring-values.yaml"), *api_versions)
    by_kind = {d["kind"]: d for d in docs}
    assert {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap", "Service"} <= set(by_kind)
    rule = by_kind["PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text())  # one source
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    rendered = tmp_path / "rendered.rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run hack/setup.sh (hack/setup.d/60-prometheus.sh)"
    check = subprocess.run([promtool, "check", "rules", str(rendered)], capture_output=True, text=True, timeout=60)
    print(check.stdout, check.stderr)
    assert check.returncode == 0 and f"SUCCESS: {len(rules())} rules found" in check.stdout
    dashboard = by_kind["ConfigMap"]
    assert json.loads(dashboard["data"]["phasesplit.json"]) == json.loads(DASHBOARD.read_text())
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    monitor = by_kind["ServiceMonitor"]["spec"]["endpoints"][0]
    assert monitor["port"] == "metrics" and monitor["honorLabels"] is True
    deployment = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-port=8081" in deployment["args"]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in deployment["ports"]
    # Without the Prometheus Operator's kinds in the cluster, the monitors are left out (no install
    # failure); by default, nothing of it renders.
    kinds = {d["kind"] for d in helm_template("-f", str(CHART / "ci" / "monitoring-values.yaml"))}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"} and "ConfigMap" in kinds
    kinds = {d["kind"] for d in helm_template(*api_versions)}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap"}


def test_docs_dashboard_is_the_charts():
    assert (ROOT / "docs" / "dashboards" / "phasesplit.json").read_bytes() == DASHBOARD.read_bytes()


def test_alert_logic_with_promtool_unit_tests():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run hack/setup.sh (hack/setup.d/60-prometheus.sh)"
    tests = ROOT / "tests" / "rules" / "phasesplit.rules.test.yaml"
    out = subprocess.run([promtool, "test", "rules", tests.name], capture_output=True, text=True, timeout=120,
                         cwd=tests.parent)
    print(out.stdout, out.stderr)
    assert out.returncode == 0 and "SUCCESS" in out.stdout
    # Every alert has a case there.
    tested = set(re.findall(r"alertname: (\w+)", tests.read_text()))
    assert {r["alert"] for r in rules() if "alert" in r} - tested <= {
        "PhasesplitTTFTBudgetBurnSlow", "PhasesplitITLBudgetBurnSlow"}  # as their fast twins, longer windows
