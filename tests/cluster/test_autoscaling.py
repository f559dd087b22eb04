"""Planner mode live (issue 4, acceptance 2): real runtime processes on this machine under a load
step from the bench tool, their metrics read through the real Prometheus, and the operator
scaling the InferenceService's Deployments on the real control plane (kwok runs the pods).

The InferenceService's metrics source points at the local Prometheus, which scrapes a local
colocated runtime serving the model name the spec declares: that is the "metrics-source
override" (kwok pods serve nothing). The operator runs as a local process, as in
test_operator.py. Timing assertions are about the control loop's own promises (a decision
within two intervals of a miss; no scale-down before the stabilization window has passed), with
slack for Prometheus's 1 s scrape and the operator's 1 s timer tick.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import httpx
import pytest
from kubernetes import client

from phasesplit.operator import api
from phasesplit.runtime import metric_names as names
from tests import waiting
from tests.integration.test_metrics_prometheus import SCRAPE_S, running_prometheus
from tests.kubecluster import KubeCluster
from tests.procs import serve

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
INTERVAL_S = 5
WINDOW_S = 30  # scale-down stabilization
SLACK_S = SCRAPE_S + 6  # a scrape, a timer tick, and applying the children on a busy machine


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    proc = serve("both", tmp_path_factory.mktemp("runtime"), "--max-model-len", "512", "--max-num-seqs", "4")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def prometheus(runtime, tmp_path_factory):
    with running_prometheus([runtime.url.removeprefix("http://")], tmp_path_factory.mktemp("prometheus")) as url:
        yield url


@pytest.fixture(scope="module")
def namespace(kube_cluster: KubeCluster):
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                         str(ROOT / "crds" / f"{api.GROUP}_{api.PLURAL}.yaml"))
    core = client.CoreV1Api(kube_cluster.api_client)
    name = f"autoscale-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_for("the default ServiceAccount",
             lambda: core.list_namespaced_service_account(name, field_selector="metadata.name=default").items)
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="module")
def operator(kube_cluster: KubeCluster, namespace: str, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        health = f"http://127.0.0.1:{s.getsockname()[1]}/healthz"
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "phasesplit.runtime.cli", "operator", "--liveness", health,
                             f"--namespace={namespace}"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=dict(os.environ, KUBECONFIG=kube_cluster.kubeconfig, PYTHONUNBUFFERED="1"))

    def live() -> bool:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    wait_for("the operator's liveness endpoint", live, timeout=60)
    yield log_path
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    print(f"\n--- operator log tail ---\n{log_path.read_text()[-4000:]}")


def wait_for(what, probe, timeout: float = 90.0, interval: float = 0.5):
    return waiting.wait_until(what, probe, timeout, interval)


def test_load_step_scales_up_within_two_intervals_and_down_after_the_window(
        kube_cluster: KubeCluster, namespace: str, runtime, prometheus, operator, tmp_path):
    custom = client.CustomObjectsApi(kube_cluster.api_client)
    apps = client.AppsV1Api(kube_cluster.api_client)
    name = "chat"
    # The spec names the model as the runtime serves it: that is the `model` label of its metrics.
    model = httpx.get(runtime.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    spec = {
        "model": {"name": model, "builtin": "smollm2"},
        "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
        "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
        "slo": {"ttft": "500ms", "itl": "200ms", "percentile": 90},
        "autoscaling": {"mode": "Planner", "interval": f"{INTERVAL_S}s",
                        "metrics": {"source": "prometheus", "url": prometheus},
                        "behavior": {"scaleDown": {"stabilizationWindowSeconds": WINDOW_S}}},
    }
    custom.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, {
        "apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": spec})

    def replicas() -> tuple[int, int]:
        return tuple(apps.read_namespaced_deployment(f"{name}-{p}", namespace).spec.replicas
                     for p in ("prefill", "decode"))

    def autoscaling() -> dict:
        obj = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        return (obj.get("status") or {}).get("autoscaling") or {}

    # Idle: the planner runs, reads fresh (empty) windows, and leaves 1+1 alone.
    wait_for("a planner step with fresh metrics", lambda: any(
        c["type"] == "MetricsAvailable" and c["status"] == "True" for c in autoscaling().get("conditions", [])),
        timeout=120)
    time.sleep(2 * INTERVAL_S)
    assert replicas() == (1, 1), autoscaling()

    # A sampler records, every 0.25 s, both Deployments' replicas and the runtime's queues.
    samples: list[tuple[float, tuple[int, int], float, float]] = []  # (t, replicas, waiting, running)
    stop = threading.Event()

    def gauges() -> tuple[float, float]:
        page = httpx.get(runtime.url + "/metrics", timeout=5).text
        values = {}
        for line in page.splitlines():
            for key in (names.WAITING + "{", names.RUNNING + "{"):
                if line.startswith(key):
                    values[key] = float(line.rsplit(" ", 1)[1])
        return values.get(names.WAITING + "{", 0.0), values.get(names.RUNNING + "{", 0.0)

    def sample() -> None:
        while not stop.is_set():
            try:
                samples.append((time.monotonic(), replicas(), *gauges()))
            except Exception:  # noqa: BLE001 - a missed sample is not a result
                pass
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # The load step: more than one CPU process serves, so queues and TTFT blow up (and the
    # runtime answers what exceeds its admission limit with 429). It arrives for 15 s, three
    # intervals: a step, not a blip that a fast CPU drains before two windows have seen it.
    bench = subprocess.Popen(
        [sys.executable, "-m", "phasesplit.runtime.cli", "bench", "--url", runtime.url, "--model", model,
         "--workload", "fixed", "--input-len", "384", "--output-len", "16", "--num-prompts", "150",
         "--request-rate", "10", "--warmup", "0", "--no-progress", "--output-json", str(tmp_path / "bench.json")],
        stdout=open(tmp_path / "bench.log", "wb"), stderr=subprocess.STDOUT)
    try:
        # The load starts when the runtime has work (the bench process itself takes a while to start).
        t_load = wait_for("the first request to reach the runtime",
                          lambda: next((t for t, _, w, r in samples if w + r > 0), None), timeout=120, interval=0.2)
        t_up = wait_for("a scale-up", lambda: next((t for t, r, _, _ in samples if max(r) > 1), None),
                        timeout=4 * INTERVAL_S + SLACK_S, interval=0.25)
        print(f"\nscaled up {t_up - t_load:.1f} s after the load started: {autoscaling()['lastDecision']['reason']}")
        assert t_up - t_load <= 2 * INTERVAL_S + SLACK_S
        bench.wait(timeout=600)
        print((tmp_path / "bench.log").read_text()[-600:])
        # Every phase that scaled up comes down again once the window has passed.
        wait_for("the scale-down of every raised phase",
                 lambda: samples[-1][1] == (1, 1), timeout=WINDOW_S + 8 * INTERVAL_S, interval=0.5)
    finally:
        stop.set()
        sampler.join(timeout=10)
    # Scale-down waits for the stabilization window after the last time the load could have
    # asked for more: the last sample with queued (prefill) or any (decode) work, plus the metrics
    # window and a decision tick (≤ 2 intervals) that may still have seen it.
    for i, phase in enumerate(("prefill", "decode")):
        peak_t = max((t for t, r, _, _ in samples if r[i] > 1), default=None)
        if peak_t is None:
            continue
        pressure = [t for t, _, w, r in samples if (w > 0 if phase == "prefill" else w + r > 0)]
        last_pressure = max(pressure)
        first_drop = min(t for t, r, _, _ in samples if t > peak_t - 0.01 and r[i] == 1)
        held = first_drop - last_pressure
        print(f"{phase}: load pressure ended {last_pressure - t_load:.1f} s in; dropped {held:.1f} s later")
        assert held >= WINDOW_S - 2 * INTERVAL_S - SLACK_S, (phase, held)
        assert held <= WINDOW_S + 6 * INTERVAL_S + SLACK_S, (phase, held)

    status = autoscaling()
    assert status["mode"] == "Planner" and status["lastDecision"]["reason"]
    events = client.CoreV1Api(kube_cluster.api_client).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},reason=Scaled").items
    assert len(events) >= 2 and all("→" in e.message for e in events)
