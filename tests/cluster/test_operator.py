"""The operator end to end on the real control plane (the issue's acceptance 1-5).

The chart is installed with helm; its operator image cannot run here (no container runtime: kwok
only pretends pods run), so the operator runs as a local process that authenticates with a
TokenRequest token of the chart's ServiceAccount. Every API call it makes is therefore checked
against the chart's RBAC: a permission the chart forgot fails these tests.

Several test sessions may share one cluster, so everything here is named per session (release,
namespaces) and this session's operator watches only this session's namespaces (one test runs a
second, cluster-wide operator to cover the default mode).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from phasesplit.operator import api, render
from phasesplit.runtime import metric_names as names
from tests import waiting
from tests.kubecluster import KubeCluster
from tests.unit.test_operator_api import INVALID_SPECS, MINIMAL, merged

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "phasesplit"
SESSION = uuid.uuid4().hex[:6]
RELEASE = OPERATOR_NS = f"phasesplit-{SESSION}"  # the chart names its objects after the release
WATCHED = {k: f"op-{SESSION}-{k}" for k in ("samples", "lifecycle", "restart", "drain")}
UNWATCHED = f"op-{SESSION}-invalid"  # validation needs only the API server
CHILD_SELECTOR = "app.kubernetes.io/managed-by=phasesplit-operator"
T = TypeVar("T")


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 90.0, interval: float = 0.25) -> T:
    return waiting.wait_until(what, probe, timeout, interval)


def denials(log: str) -> list[str]:
    """Log lines where RBAC refused the operator something (not, say, a terminating namespace)."""
    return [line for line in log.splitlines()
            if 'forbidden: User "system:serviceaccount:' in line or "Not enough permissions" in line
            or "ReconcileFailed" in line]


def isvc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": spec}


RESYNC_S = 10  # the operators' --resync-period here (5 minutes by default)


class Operator:
    """`phasesplit operator` as a local process with the chart ServiceAccount's credentials.

    Its leader-election Lease goes in the release namespace, where the chart grants it (in a pod
    that is the pod's own namespace).
    """

    def __init__(self, kubeconfig: Path, log: Path, namespaces: list[str]):
        self.kubeconfig, self.log, self.namespaces = kubeconfig, log, namespaces
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        with socket.socket() as s, socket.socket() as m:
            s.bind(("127.0.0.1", 0))
            m.bind(("127.0.0.1", 0))
            port, metrics_port = s.getsockname()[1], m.getsockname()[1]
        self.health = f"http://127.0.0.1:{port}/healthz"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1")
        out = open(self.log, "a")
        out.write(f"\n===== start {self.starts} =====\n")
        out.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phasesplit.runtime.cli", "operator", "--liveness", self.health,
             f"--metrics-port={metrics_port}", f"--leader-election-namespace={OPERATOR_NS}",
             f"--resync-period={RESYNC_S}s", *[f"--namespace={ns}" for ns in self.namespaces]],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.starts += 1
        wait_until("the operator's liveness endpoint", self._live, timeout=60)

    def _live(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the operator exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.health, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of the operator's own /metrics (--metrics-port), None when absent."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return sample.value
        return None

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:])

    def since_start(self) -> str:
        """The log of the current run."""
        return self.log.read_text().rpartition(f"===== start {self.starts - 1} =====")[2]

    def leading(self) -> bool:
        return "acquired the Lease" in self.since_start().rpartition("lost the Lease")[2]


def _create_namespace(cluster: KubeCluster, name: str) -> None:
    core = client.CoreV1Api(cluster.api_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    # Pods are admitted only once the namespace's `default` ServiceAccount exists.
    wait_until(f"ServiceAccount {name}/default",
               lambda: core.list_namespaced_service_account(name, field_selector="metadata.name=default").items)


@pytest.fixture(scope="module")
def helm_release(kube_cluster: KubeCluster) -> Iterator[KubeCluster]:
    helm = os.path.join(kube_cluster.bin_dir, "helm")
    out = subprocess.run([helm, "install", RELEASE, str(CHART), "-n", OPERATOR_NS, "--create-namespace"],
                         env=kube_cluster.env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "kubectl apply -f" in out.stdout  # NOTES.txt tells how to apply a sample
    # Helm installs a chart's CRD only when absent; another session (or an older checkout) may
    # have installed an older one, so bring it up to date the documented way.
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                         str(ROOT / "crds" / f"{api.GROUP}_{api.PLURAL}.yaml"))
    for ns in [*WATCHED.values(), UNWATCHED]:
        _create_namespace(kube_cluster, ns)
    yield kube_cluster
    subprocess.run([helm, "uninstall", RELEASE, "-n", OPERATOR_NS, "--wait"], env=kube_cluster.env,
                   capture_output=True, text=True, timeout=300)
    core = client.CoreV1Api(kube_cluster.api_client)
    for ns in [*WATCHED.values(), UNWATCHED, OPERATOR_NS]:
        core.delete_namespace(ns)


def _service_account_kubeconfig(cluster: KubeCluster, path: Path) -> Path:
    """A kubeconfig holding only a TokenRequest token of the chart's ServiceAccount."""
    core = client.CoreV1Api(cluster.api_client)
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
        audiences=[], expiration_seconds=7200))
    token = core.create_namespaced_service_account_token(RELEASE, OPERATOR_NS, request).status.token
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    ctx = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster_entry = next(c for c in admin["clusters"] if c["name"] == ctx["cluster"])
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "local", "cluster": cluster_entry["cluster"]}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": "operator"}}],
    }))
    return path


@pytest.fixture(scope="module")
def operator(helm_release: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    tmp = tmp_path_factory.mktemp("operator")
    op = Operator(_service_account_kubeconfig(helm_release, tmp / "kubeconfig"), tmp / "operator.log",
                  list(WATCHED.values()))
    op.start()
    yield op
    op.kill(signal.SIGTERM)
    print(f"\n--- operator log tail ({op.log}) ---\n{op.tail(40)}")


@pytest.fixture
def namespace(kube_cluster: KubeCluster) -> Iterator[str]:
    """A fresh namespace that this session's operator does not watch."""
    name = f"op-{SESSION}-{uuid.uuid4().hex[:6]}"
    _create_namespace(kube_cluster, name)
    yield name
    try:
        client.CoreV1Api(kube_cluster.api_client).delete_namespace(name)
    except client.ApiException as e:
        if e.status != 404:  # a test may have deleted it itself
            raise


# ---------------------------------------------------------------------------------------------
# reading the cluster


class View:
    def __init__(self, cluster: KubeCluster, namespace: str):
        self.cluster, self.ns = cluster, namespace
        self.custom = client.CustomObjectsApi(cluster.api_client)
        self.apps = client.AppsV1Api(cluster.api_client)
        self.core = client.CoreV1Api(cluster.api_client)

    def apply(self, obj: dict[str, Any]) -> None:
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps(obj))

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, self.ns, api.PLURAL, name)

    @staticmethod
    def condition(obj: dict[str, Any], kind: str = "Ready") -> dict[str, Any] | None:
        conds = (obj.get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == kind), None)

    def ready(self, name: str) -> dict[str, Any] | None:
        obj = self.get(name)  # one read: condition and counts must come from the same version
        cond = self.condition(obj)
        if cond and cond["status"] == "True" and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]:
            return obj
        return None

    def wait_ready(self, name: str, timeout: float = 120) -> dict[str, Any]:
        return wait_until(f"{self.ns}/{name} Ready (condition: {{}})", lambda: self.ready(name), timeout)

    def children(self, instance: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
        """Every object the operator manages in the namespace, as (kind, name) -> object."""
        selector = CHILD_SELECTOR + (f",app.kubernetes.io/instance={instance}" if instance else "")
        kinds = "deployments,services,serviceaccounts,roles,rolebindings,poddisruptionbudgets,networkpolicies," \
                "horizontalpodautoscalers"
        items = json.loads(self.cluster.kubectl("get", kinds, "-n", self.ns, "-l", selector, "-o", "json").stdout)
        return {(i["kind"], i["metadata"]["name"]): i for i in items["items"]}

    def deployment(self, name: str) -> client.V1Deployment:
        return self.apps.read_namespaced_deployment(name, self.ns)

    def events(self, name: str) -> list[str]:
        evs = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={name},"
                                                                       f"involvedObject.kind={api.KIND}").items
        return [e.reason for e in evs]


def expected_children(name: str, hpa: bool = False) -> set[tuple[str, str]]:
    out = {("ServiceAccount", f"{name}-router"), ("Role", f"{name}-router"), ("RoleBinding", f"{name}-router")}
    out |= {(k, f"{name}-{c}") for k in ("Service", "Deployment", "PodDisruptionBudget") for c in api.COMPONENTS}
    out |= {("NetworkPolicy", f"{name}-{p}") for p in api.PHASES}
    if hpa:
        out |= {("HorizontalPodAutoscaler", f"{name}-{p}") for p in api.PHASES}
    return out


# ---------------------------------------------------------------------------------------------
# 1. install


def test_helm_installs_crd_rbac_and_operator(helm_release: KubeCluster, operator: Operator):
    k = helm_release.kubectl
    crd = json.loads(k("get", "crd", f"{api.PLURAL}.{api.GROUP}", "-o", "json").stdout)
    assert any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])
    assert k("get", "serviceaccount", RELEASE, "-n", OPERATOR_NS).returncode == 0
    assert k("get", "clusterrole", RELEASE).returncode == 0
    assert k("get", "clusterrolebinding", RELEASE).returncode == 0
    dep = json.loads(k("get", "deployment", RELEASE, "-n", OPERATOR_NS, "-o", "json").stdout)
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == RELEASE
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["args"][0] == "operator" and container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The token really is the ServiceAccount's, and it is not an admin.
    who = subprocess.run([os.path.join(helm_release.bin_dir, "kubectl"), "--kubeconfig", str(operator.kubeconfig),
                          "auth", "can-i", "delete", "nodes"], capture_output=True, text=True)
    assert who.stdout.strip() == "no"
    explained = k("explain", "inferenceservice.spec.slo").stdout
    assert "Time-to-first-token target" in explained and "percentile" in explained


# ---------------------------------------------------------------------------------------------
# 2. samples


@pytest.mark.parametrize("sample", ["smollm2", "gpu", "gpu-tp"])
def test_sample_becomes_ready(operator: Operator, kube_cluster: KubeCluster, sample: str):
    namespace = WATCHED["samples"]
    view = View(kube_cluster, namespace)
    doc = yaml.safe_load((ROOT / "manifests" / "samples" / f"{sample}.yaml").read_text())
    name, spec = doc["metadata"]["name"], api.InferenceServiceSpec.model_validate(doc["spec"])
    t0 = time.monotonic()
    view.apply(doc)
    obj = view.wait_ready(name)
    print(f"\n{sample}: Ready after {time.monotonic() - t0:.1f} s")
    assert set(view.children(name)) == expected_children(name)
    want = {"prefill": spec.prefill.replicas, "decode": spec.decode.replicas, "router": spec.router.replicas}
    for component, replicas in want.items():
        got = dict(obj["status"][component])
        # The phases' measured start-up (kwok: Ready at once) may be in already; never the router's.
        startup = got.pop("startupSeconds", None)
        assert startup is None or (component != "router" and 0 <= startup < 60), (component, startup)
        assert got == {"replicas": replicas, "readyReplicas": replicas,
                       "desiredReplicas": replicas, "summary": f"{replicas}/{replicas}"}
        dep = view.deployment(f"{name}-{component}")
        assert dep.spec.replicas == replicas and dep.status.ready_replicas == replicas
        container = dep.spec.template.spec.containers[0]
        assert container.args[:2] == ["serve", f"--role={component}"]
        if spec.runtime.device == "cuda" and component in api.PHASES:  # one GPU per tensor-parallel rank
            tp = spec.phase(component).tensor_parallel_size
            assert container.resources.limits["nvidia.com/gpu"] == str(tp)
            assert (f"--tensor-parallel-size={tp}" in container.args) == (tp > 1)
    assert obj["status"]["endpoint"] == f"http://{name}-router.{namespace}.svc"
    conds = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert conds == {"Ready": "True", "PrefillReady": "True", "DecodeReady": "True", "RouterReady": "True"}
    # Pods really run (kwok) and were scheduled onto the fake GPU nodes.
    pods = view.core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={name}").items
    assert len(pods) == sum(want.values())
    assert all(p.status.phase == "Running" and p.spec.node_name.startswith("kwok-") for p in pods)
    headless = view.core.read_namespaced_service(f"{name}-decode", namespace)
    assert headless.spec.cluster_ip == "None" and [p.port for p in headless.spec.ports] == [8000, 9000]
    table = kube_cluster.kubectl("get", "psvc", "-n", namespace).stdout.splitlines()
    print("\n".join(table))
    assert table[0].split() == ["NAME", "READY", "PREFILL", "DECODE", "ENDPOINT", "AGE"]
    row = next(r.split() for r in table[1:] if r.split()[0] == name)  # the samples share the namespace
    assert row[:5] == [name, "True", f"{want['prefill']}/{want['prefill']}", f"{want['decode']}/{want['decode']}",
                       obj["status"]["endpoint"]]
    assert "Created" in view.events(name)
    # The operator exports the spec's SLO for the alert rules to join the runtime's histograms with.
    labels = {"namespace": namespace, "inferenceservice": name, "model": spec.model.name, "slo": "ttft"}
    assert operator.metric(names.OPERATOR_SLO_TARGET, **labels) == api.parse_duration(spec.slo.ttft)


# ---------------------------------------------------------------------------------------------
# 3. updates, drift, deletion


def test_updates_drift_and_deletion(operator: Operator, kube_cluster: KubeCluster):
    namespace = WATCHED["lifecycle"]
    view = View(kube_cluster, namespace)
    name = "chat"
    view.apply(isvc(name, MINIMAL))  # the minimal object: 1 router, 1 prefill, 2 decode
    obj = view.wait_ready(name)
    assert [obj["status"][c]["summary"] for c in api.COMPONENTS] == ["1/1", "2/2", "1/1"]
    assert obj["spec"]["autoscaling"]["mode"] == "Planner"  # defaults filled in by the API server

    # Spec changes reach the children.
    changed = merged(MINIMAL, {"decode": {"replicas": 3, "resources": {"limits": {"cpu": "2", "memory": "4Gi"}}},
                               "runtime": {"image": "example.com/phasesplit/runtime:2"}})
    view.apply(isvc(name, changed))
    obj = view.wait_ready(name)
    assert obj["status"]["decode"]["summary"] == "3/3"
    decode = view.deployment(f"{name}-decode")
    assert decode.spec.replicas == 3
    assert decode.spec.template.spec.containers[0].resources.limits == {"cpu": "2", "memory": "4Gi"}
    for component in api.COMPONENTS:
        assert view.deployment(f"{name}-{component}").spec.template.spec.containers[0].image == \
            "example.com/phasesplit/runtime:2"

    # Hand edits are put back.
    kube_cluster.kubectl("scale", "deployment", f"{name}-decode", "-n", namespace, "--replicas=5")
    wait_until("decode replicas reverted to 3", lambda: view.deployment(f"{name}-decode").spec.replicas == 3)
    kube_cluster.kubectl("set", "image", f"deployment/{name}-router", "runtime=evil:latest", "-n", namespace)
    wait_until("router image reverted", lambda: view.deployment(f"{name}-router").spec.template.spec
               .containers[0].image == "example.com/phasesplit/runtime:2")
    kube_cluster.kubectl("label", "networkpolicy", f"{name}-decode", "-n", namespace,
                         "app.kubernetes.io/component=hacked", "--overwrite")
    wait_until("NetworkPolicy label reverted", lambda: view.children(name).get(
        ("NetworkPolicy", f"{name}-decode"), {}).get("metadata", {}).get("labels", {})
        .get("app.kubernetes.io/component") == "decode")

    # Deleted children come back (with a new uid).
    for kind, child in [("service", f"{name}-prefill"), ("deployment", f"{name}-router"),
                        ("rolebinding", f"{name}-router")]:
        old = json.loads(kube_cluster.kubectl("get", kind, child, "-n", namespace, "-o", "json").stdout)
        kube_cluster.kubectl("delete", kind, child, "-n", namespace, "--wait=true")

        def back(kind=kind, child=child, old=old):
            got = kube_cluster.kubectl("get", kind, child, "-n", namespace, "-o", "json", check=False)
            return got.returncode == 0 and json.loads(got.stdout)["metadata"]["uid"] != old["metadata"]["uid"]
        wait_until(f"{kind} {child} recreated", back)
    view.wait_ready(name)
    reasons = view.events(name)
    assert "Reverted" in reasons and "Recreated" in reasons and "Updated" in reasons

    # HPA mode: autoscalers appear, and the replicas of the phase Deployments are theirs to set.
    view.apply(isvc(name, merged(changed, {"autoscaling": {"mode": "HPA"}})))
    wait_until("HPAs rendered", lambda: set(view.children(name)) == expected_children(name, hpa=True))
    hpa = client.AutoscalingV2Api(kube_cluster.api_client).read_namespaced_horizontal_pod_autoscaler(
        f"{name}-decode", namespace)
    assert hpa.spec.scale_target_ref.name == f"{name}-decode"
    assert [m.pods.metric.name for m in hpa.spec.metrics] == [names.WAITING, names.KV_USAGE]
    assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (1, 4)
    view.wait_ready(name)
    kube_cluster.kubectl("scale", "deployment", f"{name}-decode", "-n", namespace, "--replicas=4")
    time.sleep(5)  # the operator sees the change (a watch event) and must leave it alone
    assert view.deployment(f"{name}-decode").spec.replicas == 4
    assert view.get(name)["status"]["decode"]["desiredReplicas"] == 4
    # Back to Disabled: the autoscalers are pruned and the spec's replicas return.
    view.apply(isvc(name, merged(changed, {"autoscaling": {"mode": "Disabled"}})))
    wait_until("HPAs pruned", lambda: set(view.children(name)) == expected_children(name))
    wait_until("decode back to 3 replicas", lambda: view.deployment(f"{name}-decode").spec.replicas == 3)
    assert "Deleted" in view.events(name)

    # Deleting the InferenceService removes every child through owner references.
    kube_cluster.kubectl("delete", "psvc", name, "-n", namespace)
    wait_until("all children garbage-collected", lambda: view.children(name) == {}, timeout=120)
    selector = f"app.kubernetes.io/instance={name}"
    wait_until("all pods gone", lambda: view.core.list_namespaced_pod(namespace, label_selector=selector).items == [],
               timeout=120)


def test_apply_failure_is_reported_then_recovers(operator: Operator, kube_cluster: KubeCluster):
    """A spec the CRD accepts but a child's own validation refuses: Ready=False with the API
    server's message, a Warning Event, and recovery once the spec is fixed."""
    namespace = WATCHED["lifecycle"]
    view = View(kube_cluster, namespace)
    name = "overcommit"
    bad = merged(MINIMAL, {"decode": {"resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}}})
    view.apply(isvc(name, bad))

    def failed():
        cond = View.condition(view.get(name))
        return cond if cond and cond["reason"] == "ReconcileFailed" else None
    cond = wait_until("Ready=False with ReconcileFailed", failed)
    print(f"\nReady={cond['status']} {cond['reason']}: {cond['message']}")
    assert cond["status"] == "False" and "resources.requests" in cond["message"]
    warnings = [e for e in view.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},type=Warning").items if e.reason == "ApplyFailed"]
    assert warnings and f"Deployment {name}-decode" in warnings[0].message
    # The refused child held back nothing else: the router and prefill still got applied.
    assert {("Deployment", f"{name}-router"), ("Deployment", f"{name}-prefill")} <= set(view.children(name))
    view.apply(isvc(name, merged(MINIMAL, {"decode": {"resources": {"requests": {"cpu": "2"},
                                                                    "limits": {"cpu": "2"}}}})))
    view.wait_ready(name)
    # The operator's metrics counted the failed reconciles (the reconcile-errors alert reads them).
    svc = {"namespace": namespace, "inferenceservice": name}
    errors = operator.metric(names.OPERATOR_RECONCILE_ERRORS, **svc)
    total = operator.metric(names.OPERATOR_RECONCILES, **svc)
    print(f"reconciles of {name}: {total} ({errors} failed)")
    assert errors and errors >= 1 and total and total > errors
    assert operator.metric(names.OPERATOR_RECONCILE_SECONDS + "_count", **svc) == total
    kube_cluster.kubectl("delete", "psvc", name, "-n", namespace)


# ---------------------------------------------------------------------------------------------
# 4. validation by the API server


@pytest.mark.parametrize("case,patch,field", INVALID_SPECS, ids=[c[0] for c in INVALID_SPECS])
def test_invalid_spec_rejected_naming_the_field(helm_release: KubeCluster, case, patch, field):
    namespace = UNWATCHED
    out = helm_release.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                               input=json.dumps(isvc(f"bad-{case}", merged(MINIMAL, patch))))
    assert out.returncode != 0, f"{case} was accepted"
    message = out.stderr.strip()
    print(f"\n{case}: {message}")
    assert field in message, message
    # Nothing was stored.
    got = helm_release.kubectl("get", "psvc", f"bad-{case}", "-n", namespace, check=False)
    assert got.returncode != 0


def test_minimal_object_is_valid_as_written(helm_release: KubeCluster):
    namespace = UNWATCHED
    out = helm_release.kubectl("apply", "--dry-run=server", "-o", "json", "-n", namespace, "-f", "-",
                               input=json.dumps(isvc("chat", MINIMAL)))
    spec = json.loads(out.stdout)["spec"]
    assert spec["decode"]["replicas"] == 2 and spec["router"]["replicas"] == 1
    assert spec["slo"] == {"ttft": "500ms", "itl": "50ms", "percentile": 90}
    assert spec["kvTransfer"]["port"] == 9000


# ---------------------------------------------------------------------------------------------
# 5. killed mid-reconcile


def test_killed_mid_reconcile_converges_without_duplicates(operator: Operator, kube_cluster: KubeCluster):
    namespace = WATCHED["restart"]
    view = View(kube_cluster, namespace)
    names = [f"svc{i}" for i in range(6)]
    # Many services at once, so that the kill lands while children are still being applied.
    kube_cluster.kubectl("apply", "-n", namespace, "-f", "-",
                         input="\n---\n".join(json.dumps(isvc(n, MINIMAL)) for n in names))
    wait_until("the first child", lambda: view.children() != {}, interval=0.02)
    operator.kill(signal.SIGKILL)
    partial = len(view.children())
    total = sum(len(expected_children(n)) for n in names)
    print(f"\nkilled the operator with {partial}/{total} children applied")
    assert 0 < partial < total, "the kill did not land mid-reconcile: this test checked nothing"
    operator.start()
    for n in names:
        view.wait_ready(n)
    children = view.children()
    assert set(children) == set().union(*(expected_children(n) for n in names))
    # No duplicate work: one ReplicaSet per Deployment (no spurious rollout), one uid per name.
    rs = view.apps.list_namespaced_replica_set(namespace).items
    assert sorted(r.metadata.owner_references[0].name for r in rs) == sorted(
        name for kind, name in children if kind == "Deployment")
    # A graceful restart on a converged cluster changes nothing at all.
    before = {k: v["metadata"]["resourceVersion"] for k, v in children.items()}
    operator.kill(signal.SIGTERM)
    operator.start()
    time.sleep(5)
    after = {k: v["metadata"]["resourceVersion"] for k, v in view.children().items()}
    assert after == before


def _apiserver_pid(cluster: KubeCluster) -> int:
    return int((Path(cluster.kubeconfig).parent / "pids" / "kube-apiserver").read_text())


def test_child_deleted_around_an_api_server_outage_comes_back(operator: Operator, kube_cluster: KubeCluster):
    """The API server hangs (SIGSTOP: connections open, nothing answers) for 30 s right after a
    child is deleted: the operator's calls time out instead of hanging, the failed pass is
    retried, and the child is back within a resync period of the server's return."""
    namespace = WATCHED["restart"]
    view = View(kube_cluster, namespace)
    name = "outage"
    view.apply(isvc(name, MINIMAL))
    view.wait_ready(name)
    old = view.core.read_namespaced_service(f"{name}-prefill", namespace).metadata.uid
    pid = _apiserver_pid(kube_cluster)
    view.core.delete_namespaced_service(f"{name}-prefill", namespace)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(30)
    finally:
        os.kill(pid, signal.SIGCONT)
    back = time.monotonic()

    def recreated():
        try:
            return view.core.read_namespaced_service(f"{name}-prefill", namespace).metadata.uid != old
        except client.ApiException:
            return False
    # Leadership may have lapsed during the outage (the Lease could not be renewed): allow for
    # taking it back (a Lease period) on top of the resync period.
    wait_until("the deleted Service back", recreated, timeout=RESYNC_S + 15 + 30)
    print(f"\nService back {time.monotonic() - back:.1f} s after the API server returned")
    view.wait_ready(name)
    assert operator.proc.poll() is None
    kube_cluster.kubectl("delete", "psvc", name, "-n", namespace)


def test_two_operators_only_one_acts(operator: Operator, kube_cluster: KubeCluster, tmp_path: Path):
    """A second replica (same scope, same Lease) stays idle while the first leads, and takes over
    when the leader dies."""
    namespace = WATCHED["restart"]
    view = View(kube_cluster, namespace)
    wait_until("the first operator leading", operator.leading, timeout=60)
    second = Operator(operator.kubeconfig, tmp_path / "second.log", operator.namespaces)
    second.start()
    try:
        view.apply(isvc("pair", MINIMAL))
        view.wait_ready("pair")
        time.sleep(3)
        assert not second.leading()
        assert "applied" not in second.since_start(), second.tail()
        assert f"{namespace}/pair: applied" in operator.since_start()
        # The leader dies without handing over: the other takes the Lease once it expires.
        operator.kill(signal.SIGKILL)
        wait_until("the second operator leading", second.leading, timeout=60)
        view.apply(isvc("pair", merged(MINIMAL, {"decode": {"replicas": 3}})))
        wait_until("the change applied by the new leader",
                   lambda: view.deployment("pair-decode").spec.replicas == 3)
        # The apply lands before the operator logs it: wait for the line rather than race it.
        wait_until("the new leader's apply in its log",
                   lambda: f"{namespace}/pair: applied" in second.since_start(), timeout=30)
    finally:
        second.kill(signal.SIGTERM)  # hands the Lease over at once
        operator.start()
    wait_until("the first operator leading again", operator.leading, timeout=60)
    kube_cluster.kubectl("delete", "psvc", "pair", "-n", namespace)


def test_namespace_deletion_with_the_operator_down_completes(operator: Operator, kube_cluster: KubeCluster,
                                                             namespace: str, tmp_path: Path):
    """No finalizer on InferenceServices: deleting their namespace needs no running operator."""
    wide = Operator(operator.kubeconfig, tmp_path / "wide.log", [namespace])
    wide.start()
    view = View(kube_cluster, namespace)
    try:
        view.apply(isvc("gone", MINIMAL))
        obj = view.wait_ready("gone")
    finally:
        wide.kill(signal.SIGKILL)
    assert not obj["metadata"].get("finalizers"), obj["metadata"]
    core = client.CoreV1Api(kube_cluster.api_client)
    core.delete_namespace(namespace)

    def gone():
        try:
            core.read_namespace(namespace)
            return False
        except client.ApiException as e:
            return e.status == 404
    wait_until(f"namespace {namespace} deleted", gone, timeout=120)


def test_cluster_wide_by_default(operator: Operator, kube_cluster: KubeCluster, namespace: str,
                                 tmp_path: Path):
    """Without --namespace the operator serves every namespace (with the same ServiceAccount)."""
    wide = Operator(operator.kubeconfig, tmp_path / "wide.log", [])
    wide.start()
    try:
        view = View(kube_cluster, namespace)
        view.apply(isvc("wide", MINIMAL))
        view.wait_ready("wide")
        assert set(view.children("wide")) == expected_children("wide")
    finally:
        wide.kill(signal.SIGTERM)
    assert not denials(wide.log.read_text()), wide.tail()


def test_operator_never_lacked_a_permission(operator: Operator):
    """Runs last in this module: the whole log of the ServiceAccount-authenticated operator."""
    assert not denials(operator.log.read_text()), operator.tail()


def test_rbac_denies_what_the_operator_does_not_need(helm_release: KubeCluster, operator: Operator):
    kubectl = os.path.join(helm_release.bin_dir, "kubectl")
    def can(*args: str) -> str:
        return subprocess.run([kubectl, "--kubeconfig", str(operator.kubeconfig), "auth", "can-i", *args],
                              capture_output=True, text=True).stdout.strip()
    assert can("patch", "deployments", "-n", "default") == "yes"
    assert can("list", "endpointslices.discovery.k8s.io", "-n", "default") == "yes"
    assert can("watch", "pods", "-n", "default") == "yes"  # measured start-up
    for verb, resource in [("get", "secrets"), ("create", "pods"), ("delete", "nodes"),
                           ("create", "clusterroles"), ("update", "deployments")]:
        assert can(verb, resource, "-n", "default") == "no", (verb, resource)


# ---------------------------------------------------------------------------------------------
# drain, never cut (issue 13)


def test_scale_down_and_rollout_terminate_pods_with_the_drain_grace(operator: Operator,
                                                                    kube_cluster: KubeCluster):
    """Every pod a scale-down or a rolling update deletes goes with the preStop delay and the
    grace period spec.drainTimeout asks for (the API server copies the pod's grace period into
    the deletion), and so does every pod that replaces it."""
    import threading

    from kubernetes import watch

    namespace = WATCHED["drain"]
    view = View(kube_cluster, namespace)
    name = "drain"
    spec = merged(MINIMAL, {"drainTimeout": "2m"})  # 1 prefill, 2 decode
    grace = render.PRESTOP_DELAY_S + 120 + render.GRACE_MARGIN_S
    terminating: dict[str, client.V1Pod] = {}
    stop = threading.Event()

    def watch_pods() -> None:
        w = watch.Watch()
        while not stop.is_set():
            for ev in w.stream(view.core.list_namespaced_pod, namespace, timeout_seconds=2):
                pod = ev["object"]
                if pod.metadata.deletion_timestamp is not None:
                    terminating.setdefault(pod.metadata.name, pod)

    watcher = threading.Thread(target=watch_pods, daemon=True)
    watcher.start()
    try:
        view.apply(isvc(name, spec))
        view.wait_ready(name)
        secret = view.core.read_namespaced_secret(f"{name}-internal", namespace)
        value = secret.data[render.INTERNAL_SECRET_KEY]
        (ref,) = secret.metadata.owner_references
        assert ref.controller and ref.uid == view.get(name)["metadata"]["uid"]
        view.apply(isvc(name, merged(spec, {"decode": {"replicas": 1}})))  # scale-down: one pod goes
        wait_until("a decode pod terminating", lambda: any("-decode-" in n for n in terminating))
        view.wait_ready(name)
        rolled = merged(spec, {"decode": {"replicas": 1}, "runtime": {"image": "example.com/phasesplit/runtime:2"}})
        view.apply(isvc(name, rolled))  # a rolling update of every Deployment
        wait_until("old pods of all three Deployments terminating",
                   lambda: {c for c in api.COMPONENTS if any(f"-{c}-" in n for n in terminating)} == set(api.COMPONENTS))
        view.wait_ready(name)
    finally:
        stop.set()
        watcher.join(10)
    pods = view.core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={name}").items
    print(f"\n{len(terminating)} pods terminated by the scale-down and the rollout, {len(pods)} running; "
          f"grace periods {sorted({p.metadata.deletion_grace_period_seconds for p in terminating.values()})} s")
    assert len(terminating) >= 4  # 1 decode scaled away + the old router, prefill and decode pods
    for pod in [*terminating.values(), *pods]:
        assert pod.spec.termination_grace_period_seconds == grace, pod.metadata.name
        (container,) = pod.spec.containers
        assert container.lifecycle.pre_stop.sleep.seconds == render.PRESTOP_DELAY_S, pod.metadata.name
        assert "--drain-timeout=120s" in container.args
    for pod in terminating.values():
        assert pod.metadata.deletion_grace_period_seconds == grace, pod.metadata.name
    # The internal secret: made once (the rollout did not change it), mounted into the service's
    # pods, never logged.
    import base64
    assert view.core.read_namespaced_secret(f"{name}-internal", namespace).data[render.INTERNAL_SECRET_KEY] == value
    assert len(base64.b64decode(value)) >= 32
    for pod in pods:
        env = {e.name: e for e in pod.spec.containers[0].env}
        assert env["PHASESPLIT_INTERNAL_SECRET"].value_from.secret_key_ref.name == f"{name}-internal"
    assert base64.b64decode(value).decode() not in operator.log.read_text()
    kube_cluster.kubectl("delete", "psvc", name, "-n", namespace)


# ---------------------------------------------------------------------------------------------
# the dashboard's cluster panels (issue 20)


def test_dashboard_cluster_panels_return_data(operator: Operator, kube_cluster: KubeCluster, tmp_path: Path):
    """The dashboard panels that need a cluster (tests/integration/test_observability.py's EXEMPT:
    replicas from kube-state-metrics joined with the operator's deployment_info, reconciles) return
    data in the real Prometheus scraping the real kube-state-metrics and this session's operator."""
    from tests.integration.test_metrics_prometheus import running_prometheus
    from tests.integration.test_observability import (
        EXEMPT,
        finite,
        panel_queries,
        query,
        query_range,
        substitute,
    )
    from tests.procs import free_port

    ksm_bin = Path(kube_cluster.bin_dir) / "kube-state-metrics"
    assert ksm_bin.exists(), "kube-state-metrics is missing: run hack/kube-tools.sh (hack/setup.sh builds it)"
    namespace = WATCHED["samples"]
    view = View(kube_cluster, namespace)
    port, telemetry = free_port(), free_port()
    log = open(tmp_path / "kube-state-metrics.log", "wb")
    ksm = subprocess.Popen([str(ksm_bin), f"--kubeconfig={kube_cluster.kubeconfig}", "--host=127.0.0.1",
                            f"--port={port}", "--telemetry-host=127.0.0.1", f"--telemetry-port={telemetry}",
                            "--resources=deployments", f"--namespaces={namespace}"],
                           stdout=log, stderr=subprocess.STDOUT)
    jobs = [  # honor_labels: kube-state-metrics' namespace label is the Deployment's, as in a cluster
        {"job_name": "kube-state-metrics", "honor_labels": True, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
        {"job_name": "phasesplit-operator", "static_configs": [{"targets": [operator.metrics_url.split("/")[2]]}]},
    ]
    name = f"dash-{SESSION}"
    try:
        with running_prometheus([], tmp_path, scrape_configs=jobs) as prom:
            start = time.time()
            view.apply(isvc(name, MINIMAL))  # reconciles while Prometheus scrapes
            view.wait_ready(name)
            wanted = [(title, ref, substitute(expr, namespace, ".*")) for title, ref, expr in panel_queries()
                      if title in EXEMPT]
            assert {t for t, _, _ in wanted} == set(EXEMPT)

            def all_have_data() -> bool:
                return not [1 for _, _, expr in wanted if not finite(query_range(prom, expr, start, time.time()))]

            wait_until("every cluster panel with data", all_have_data, timeout=90)
            for title, ref, expr in wanted:
                values = finite(query_range(prom, expr, start, time.time()))
                print(f"{title[:30]:30} {ref}  {len(values)} points, last {values[-1][1]:.4g}")
            desired = next(expr for title, _, expr in wanted if "spec_replicas" in expr)
            replicas = {m["phase"]: v for m, v in finite(query(prom, desired))}
            assert ksm.poll() is None, (tmp_path / "kube-state-metrics.log").read_text()[-2000:]
    finally:
        ksm.terminate()
        ksm.wait(timeout=30)
        log.close()
        kube_cluster.kubectl("delete", "psvc", name, "-n", namespace, "--ignore-not-found")
    # The desired-replicas series sums each component's Deployments in the namespace: this
    # service's 1 router + 1 prefill + 2 decode, plus the samples' when their test ran first.
    assert replicas.keys() == {"router", "prefill", "decode"}, replicas
    assert replicas["router"] >= 1 and replicas["prefill"] >= 1 and replicas["decode"] >= 2, replicas
