"""Scale to zero live (issue 15, acceptance 3 and 4): an InferenceService with minReplicas 0 on
the real control plane idles to 0+0, a request sent then is held by the router and answered once
the operator has brought both phases back; and the operator measures each phase's start-up from
its pods and shows it in status.

As in test_autoscaling.py, kwok runs the Deployments' pods (they serve nothing) and the serving
happens in local processes: a router with static worker URLs, and one prefill and one decode
process that this test starts and stops as the operator moves the Deployments' replicas between
0 and 1 (the kwok pods stand for them). The operator's planner reads their real /metrics through
the real Prometheus (the metrics-source override).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from kubernetes import client

from phasesplit.operator import api
from phasesplit.runtime import metric_names as names
from tests.cluster.test_autoscaling import namespace, operator, wait_for  # noqa: F401 - fixtures
from tests.integration.test_metrics_prometheus import running_prometheus
from tests.kubecluster import KubeCluster
from tests.procs import free_port, serve

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

INTERVAL_S = 5
IDLE_AFTER_S = 15
FP32 = ("--dtype", "float32", "--max-model-len", "512")


class Phases:
    """One local worker process per phase while its Deployment wants ≥ 1 replica, none at 0."""

    def __init__(self, apps: client.AppsV1Api, ns: str, name: str, logs, ports: dict[str, int]):
        self.apps, self.namespace, self.name, self.logs, self.ports = apps, ns, name, logs, ports
        self.procs: dict[str, object] = {}
        self.history: list[tuple[float, str, int]] = []  # (time, phase, replicas) as the operator set them
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def url(self, phase: str) -> str:
        return f"http://127.0.0.1:{self.ports[phase]}"

    def replicas(self) -> dict[str, int]:
        return {p: self.apps.read_namespaced_deployment(f"{self.name}-{p}", self.namespace).spec.replicas
                for p in api.PHASES}

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                want = self.replicas()
            except client.ApiException:
                want = None  # not created yet
            for phase in api.PHASES:
                if want is None:
                    continue
                n = want[phase]
                if next((h[2] for h in reversed(self.history) if h[1] == phase), None) != n:
                    self.history.append((time.monotonic(), phase, n))
                running = phase in self.procs
                if n and not running:
                    extra = ["--prefill-urls", self.url("prefill")] if phase == "decode" else []
                    self.procs[phase] = serve(phase, self.logs, *FP32, *extra, port=self.ports[phase])
                elif n == 0 and running:
                    self.procs.pop(phase).stop()
            self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        for p in self.procs.values():
            p.stop()


def held(router_url: str) -> float:
    for line in httpx.get(router_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(names.HELD + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{names.HELD} is not on the router's /metrics")


def test_idle_to_zero_then_a_held_request_wakes_both_phases(kube_cluster: KubeCluster, namespace: str,  # noqa: F811
                                                            operator, tmp_path):  # noqa: F811
    custom = client.CustomObjectsApi(kube_cluster.api_client)
    apps = client.AppsV1Api(kube_cluster.api_client)
    core = client.CoreV1Api(kube_cluster.api_client)
    name = "sleepy"
    ports = {"prefill": free_port(), "decode": free_port()}
    # The router the operator would render for this spec: --hold-for-prefill (decode may not
    # prefill locally, prefill may be at zero) and the spec's hold timeout.
    router = serve("router", tmp_path, *FP32, "--prefill-urls", f"http://127.0.0.1:{ports['prefill']}",
                   "--decode-urls", f"http://127.0.0.1:{ports['decode']}", "--hold-for-prefill",
                   "--hold-timeout", "300s")
    phases = Phases(apps, namespace, name, tmp_path, ports)
    targets = [router.url.removeprefix("http://"), *(f"127.0.0.1:{p}" for p in ports.values())]
    try:
        router.wait_ready()
        model = httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        with running_prometheus(targets, tmp_path) as prometheus:
            spec = {
                "model": {"name": model, "builtin": "smollm2"},
                "prefill": {"replicas": 1, "minReplicas": 0, "maxReplicas": 1},
                "decode": {"replicas": 1, "minReplicas": 0, "maxReplicas": 1},
                "slo": {"ttft": "2s", "itl": "200ms", "percentile": 90},
                "autoscaling": {"mode": "Planner", "interval": f"{INTERVAL_S}s",
                                "metrics": {"source": "prometheus", "url": prometheus},
                                "scaleToZero": {"idleAfter": f"{IDLE_AFTER_S}s", "holdTimeout": "300s"}},
            }
            custom.create_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, {
                "apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": spec})
            phases.thread.start()

            def status() -> dict:
                obj = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
                return obj.get("status") or {}

            def events(reason: str) -> list[str]:
                return [e.message for e in core.list_namespaced_event(
                    namespace, field_selector=f"involvedObject.name={name},reason={reason}").items]

            # Acceptance 4: the kwok pods' start-up (creation to Ready) is measured and shown.
            measured = wait_for("the measured start-up in status", lambda: (
                (status().get("prefill") or {}).get("startupSeconds") is not None
                and (status().get("decode") or {}).get("startupSeconds") is not None and status()), timeout=120)
            startup = {p: measured[p]["startupSeconds"] for p in api.PHASES}
            print(f"\nmeasured start-up (kwok pods, creation to Ready): {startup}")
            assert all(0 <= s < 60 for s in startup.values()), startup

            # Idle: nothing arrives, nothing is held; after idleAfter both phases go to 0.
            t0 = time.monotonic()
            wait_for("both phases at zero", lambda: phases.replicas() == {"prefill": 0, "decode": 0},
                     timeout=IDLE_AFTER_S + 180)
            at_zero = time.monotonic() - t0
            zero_events = wait_for("a ScaledToZero event", lambda: events("ScaledToZero"), timeout=30)
            print(f"0+0 {at_zero:.1f} s after start-up was measured; Event ScaledToZero: {zero_events[0]}")
            assert "scaled to zero after" in zero_events[0], zero_events
            # The Event is posted when the planner decides; the condition lands with the pass
            # that applies the decision and writes status, a moment later.
            def zero_condition() -> dict | None:
                conds = {c["type"]: c for c in (status().get("autoscaling") or {}).get("conditions") or []}
                return conds if "ScaledToZero" in conds else None

            conds = wait_for("the ScaledToZero condition in status", zero_condition, timeout=30)
            assert conds["ScaledToZero"]["status"] == "True", conds
            wait_for("the local workers to stop", lambda: not phases.procs, timeout=60)
            # Prometheus sees them gone (their series go stale) before the request is sent.
            wait_for("Prometheus to see the workers down", lambda: all(
                r["health"] == "down" for r in httpx.get(prometheus + "/api/v1/targets", timeout=5).json()
                ["data"]["activeTargets"] if not r["scrapeUrl"].startswith(router.url)), timeout=30)
            # The service is Ready while asleep (once the Deployments have settled at 0): the
            # router takes requests and holds them.
            wait_for("Ready at zero", lambda: {c["type"]: (c["status"], c["reason"]) for c in status()["conditions"]}
                     .get("DecodeReady") == ("True", "ScaledToZero") and any(
                         c["type"] == "Ready" and c["status"] == "True" for c in status()["conditions"]), timeout=60)

            # A request now: held at the router, it wakes both phases and is answered.
            result: dict = {}

            def send() -> None:
                t = time.monotonic()
                body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                        "temperature": 0, "stream": True}
                text = []
                with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=600) as r:
                    result["status"] = r.status_code
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            result["error"] = chunk["error"]
                            continue
                        if chunk["choices"] and chunk["choices"][0]["text"]:
                            result.setdefault("ttft", time.monotonic() - t)
                            text.append(chunk["choices"][0]["text"])
                result["text"], result["seconds"] = "".join(text), time.monotonic() - t

            sent = time.monotonic()
            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            wait_for("the request to be held at the router", lambda: held(router.url) == 1, timeout=30)
            woke = wait_for("the operator to wake both phases", lambda: next(
                (t for t, p, n in phases.history if t > sent and p == "decode" and n >= 1), None), timeout=120)
            assert phases.replicas() == {"prefill": 1, "decode": 1}
            print(f"woken {woke - sent:.1f} s after the request was sent")
            sender.join(timeout=600)
            assert result.get("status") == 200 and "error" not in result, result
            assert result["text"], result
            print(f"held request answered: TTFT {result['ttft']:.1f} s, done in {result['seconds']:.1f} s, "
                  f"text {result['text']!r}")
            woken = wait_for("a WokenFromZero event", lambda: events("WokenFromZero"), timeout=30)
            assert "woken by 1 held request" in woken[0], woken
            print(f"Event WokenFromZero: {woken[0]}")
            # Nothing lost: no request is still held and the router counted the one it answered.
            assert held(router.url) == 0
            page = httpx.get(router.url + "/metrics", timeout=5).text
            success = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                          if line.startswith(names.SUCCESS + "{"))
            assert success == 1, page
    finally:
        phases.close()
        router.stop()
