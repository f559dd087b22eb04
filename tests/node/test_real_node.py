"""End to end on a REAL node (issue 12, point 5): `helm install`, `kubectl apply`, and clients
talking to the pods the operator made, on the kubelet + containerd node of hack/node.sh.

The control plane is the shared `kube_cluster`; the node joins it (hack/node.sh up) and gets the
images built by hack/images.sh. Everything here runs for real: the operator is a pod under the
chart's ServiceAccount, the runtime pods load the model, the router discovers workers through
EndpointSlices, clients reach the router's ClusterIP through kube-proxy. Each test prints its
timings. Tests share one release and one InferenceService (module fixtures) and run in file order.

Run when PHASESPLIT_NODE=1 (./hack/test.sh sets it from its `node_default` switch, on;
PHASESPLIT_NODE=0 turns them off either way): warm (images cached, code changed) the file ran
29.7 min here at load 6-13, image rebuild and import included; cold, the runtime image (5.2 GB:
PyPI's torch with its CUDA libraries) adds ~15 min to build and ~5 min to import (docs/cluster.md,
"Figures"). Where it is on, skipped only where this machine cannot run pods: not root, or the
node's packages missing (both with the reason).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from tests import waiting
from tests.kubecluster import KubeCluster
from tests.procs import Proc, free_port

# Module fixtures (node up, image import, pods Ready) land in the first test's time, and a rollout
# on two shared cores takes minutes: the suite's 900 s per test is too tight here.
pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
NODE_SH = ROOT / "hack" / "node.sh"
IMAGES_SH = ROOT / "hack" / "images.sh"
SAMPLE = ROOT / "manifests" / "samples" / "smollm2-cpu.yaml"
CHART = ROOT / "charts" / "phasesplit"
SESSION = uuid.uuid4().hex[:6]
NS = f"node-{SESSION}"
RELEASE = f"ps-{SESSION}"
NAME = "smollm2-cpu"
ROLES = ("router", "prefill", "decode")
NODE_LABEL = "node.phasesplit.io/real"
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_TOKENS = 24
T = TypeVar("T")


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 180.0, interval: float = 0.25) -> T:
    return waiting.wait_until(what, probe, timeout, interval)


def sh(*cmd: str, env: dict[str, str] | None = None, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """A hack/ script: progress (stderr) to the terminal, stdout captured."""
    return subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env,
                          timeout=timeout)


def cannot_run_pods() -> str | None:
    if os.environ.get("PHASESPLIT_NODE") != "1":
        return ("real-node e2e tests are off (PHASESPLIT_NODE=1 runs them, as ./hack/test.sh does unless "
                "PHASESPLIT_NODE=0): warm they take ~25-30 min on this 2-core machine, cold ~20 min more of "
                "image build and import (docs/cluster.md)")
    if os.geteuid() != 0:
        return "the real node runs containers and must run as root (hack/node.sh)"
    missing = [c for c in ("containerd", "runc", "buildah", "debootstrap", "socat", "nft") if not shutil.which(c)]
    if missing:
        return f"{', '.join(missing)} not installed (hack/setup.d/55-node-packages.sh installs them)"
    return None


@dataclass
class Node:
    cluster: KubeCluster
    images: dict[str, str] = field(default_factory=dict)  # name -> image ref
    timings: dict[str, float] = field(default_factory=dict)

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, **kw)

    def ctr(self, *args: str) -> subprocess.CompletedProcess[str]:
        sock = Path(self.cluster.kubeconfig).parent / "node" / "containerd" / "containerd.sock"
        return subprocess.run(["ctr", "--address", str(sock), "-n", "k8s.io", *args], capture_output=True,
                              text=True, timeout=60)

    def pods(self, role: str | None = None, namespace: str = NS) -> list[dict[str, Any]]:
        sel = f"app.kubernetes.io/instance={NAME}" + (f",app.kubernetes.io/component={role}" if role else "")
        out = self.kubectl("-n", namespace, "get", "pods", "-l", sel, "-o", "json").stdout
        return json.loads(out)["items"]


def ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


@pytest.fixture(scope="module")
def node(kube_cluster: KubeCluster) -> Iterator[Node]:
    reason = cannot_run_pods()
    if reason:
        pytest.skip(reason)
    env = dict(kube_cluster.env, PHASESPLIT_CLUSTER_DIR=str(Path(kube_cluster.kubeconfig).parent))
    n = Node(kube_cluster)
    was_up = sh("bash", str(NODE_SH), "status", env=env, timeout=60).returncode == 0
    t0 = time.monotonic()
    up = sh("bash", str(NODE_SH), "up", env=env)
    if up.returncode != 0:
        pytest.fail(f"hack/node.sh up failed (exit {up.returncode}); see its output above")
    n.timings["node up (incl. cached tool/pause checks)"] = time.monotonic() - t0
    t0 = time.monotonic()
    built = sh("bash", str(IMAGES_SH), "--import", "runtime", "operator", env=env)
    if built.returncode != 0:
        pytest.fail(f"hack/images.sh failed (exit {built.returncode}); see its output above")
    n.timings["images (build if changed) + import"] = time.monotonic() - t0
    for line in built.stdout.splitlines():
        name, ref, _ = line.split()
        n.images[name] = ref
    kube_cluster.kubectl("create", "namespace", NS)
    wait_until("the default ServiceAccount",
               lambda: kube_cluster.kubectl("-n", NS, "get", "sa", "default", check=False).returncode == 0)
    print("\n" + "\n".join(f"[node] {k}: {v:.1f} s" for k, v in n.timings.items()))
    try:
        yield n
    finally:
        # InferenceServices first, while the operator (in this namespace) can still remove its
        # finalizer; then the release; a namespace deleted with the operator in it never finishes.
        kube_cluster.kubectl("-n", NS, "delete", "psvc", "--all", "--timeout=90s", check=False)
        for name in kube_cluster.kubectl("-n", NS, "get", "psvc", "-o", "name", check=False).stdout.split():
            kube_cluster.kubectl("-n", NS, "patch", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                                 check=False)
        subprocess.run(["helm", "uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "2m"], env=kube_cluster.env,
                       capture_output=True, timeout=200)
        kube_cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        if not was_up:
            sh("bash", str(NODE_SH), "down", env=env, timeout=300)


@pytest.fixture(scope="module")
def operator(node: Node) -> dict[str, Any]:
    """The chart installed with the locally built operator image, its pod on the real node."""
    repo, tag = node.images["operator"].rsplit(":", 1)
    t0 = time.monotonic()
    values = {
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "watchNamespace": NS,
        "nodeSelector": {NODE_LABEL: "true"},
        "tolerations": [{"key": NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
    }
    subprocess.run(["helm", "install", RELEASE, str(CHART), "-n", NS, "--wait", "--timeout", "5m",
                    "-f", "-"], input=yaml.safe_dump(values), text=True, check=True, env=node.cluster.env,
                   capture_output=True, timeout=400)
    took = time.monotonic() - t0
    pod = wait_until("the operator pod Ready", lambda: next(
        (p for p in json.loads(node.kubectl("-n", NS, "get", "pods", "-l",
                                            f"app.kubernetes.io/instance={RELEASE}", "-o", "json").stdout)["items"]
         if ready(p)), None), timeout=120)
    return {"pod": pod, "install_s": took}


def apply_sample(node: Node, spec_patch: dict[str, Any] | None = None) -> float:
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["namespace"] = NS
    if spec_patch:
        doc["spec"].update(spec_patch)
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    return time.monotonic()


@pytest.fixture(scope="module")
def service(node: Node, operator: dict[str, Any]) -> dict[str, Any]:
    """The CPU sample applied; every role's pod Ready (apply -> Ready per role recorded)."""
    t_apply = apply_sample(node)
    ready_at: dict[str, float] = {}

    def all_ready() -> bool:
        crashing = [p["metadata"]["name"] for p in node.pods()
                    for c in (p.get("status") or {}).get("containerStatuses") or [] if c["restartCount"] >= 3]
        if crashing:
            raise AssertionError(f"pods crash-looping: {crashing}")
        for role in ROLES:
            if role not in ready_at and any(ready(p) for p in node.pods(role)):
                ready_at[role] = time.monotonic() - t_apply
        return len(ready_at) == len(ROLES)

    try:
        wait_until("the router, prefill and decode pods Ready", all_ready, timeout=600, interval=0.5)
    except BaseException:
        for p in node.pods():
            name = p["metadata"]["name"]
            print(f"--- {name}: {json.dumps(p.get('status', {}))[:1500]}")
            print(node.kubectl("-n", NS, "logs", name, "--tail=40", check=False).stdout)
        raise
    svc = json.loads(node.kubectl("-n", NS, "get", "svc", f"{NAME}-router", "-o", "json").stdout)
    url = f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}"
    return {"ready_s": ready_at, "url": url}


def wait_served(url: str, timeout: float = 120) -> None:
    """The router answers through the Service and has a worker of each phase."""
    def ok() -> bool:
        try:
            r = httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi",
                                                           "max_tokens": 2}, timeout=30)
            return r.status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(f"a completion through {url}", ok, timeout=timeout, interval=1)


def chat_stream(url: str, timeout: float = 120) -> tuple[str, float, str | None]:
    """Greedy streaming chat completion with the official SDK: (text, ttft, finish_reason)."""
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)
    t0 = time.monotonic()
    ttft = None
    parts, finish = [], None
    stream = c.chat.completions.create(model="smollm2-135m", messages=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        if ch.delta and ch.delta.content:
            ttft = ttft or time.monotonic() - t0
            parts.append(ch.delta.content)
        finish = ch.finish_reason or finish
    return "".join(parts), ttft or 0.0, finish


def test_a_helm_install_runs_the_operator_as_a_pod_under_its_own_serviceaccount(node: Node, operator):
    pod = operator["pod"]
    spec = pod["spec"]
    print(f"\n[a] helm install --wait -> operator pod Ready: {operator['install_s']:.1f} s "
          f"(pod {pod['metadata']['name']} on {spec['nodeName']})")
    assert spec["nodeName"] == "phasesplit-node"
    sa = spec["serviceAccountName"]
    # The chart's own ServiceAccount (made by this release), not the namespace's `default`.
    owner = node.kubectl("-n", NS, "get", "sa", sa, "-o",
                         "jsonpath={.metadata.annotations.meta\\.helm\\.sh/release-name}").stdout
    assert sa != "default" and owner == RELEASE, (sa, owner)
    # Its RBAC is what it runs with: it may manage InferenceServices' children here...
    can = node.kubectl("auth", "can-i", "create", "deployments", "-n", NS, f"--as=system:serviceaccount:{NS}:{sa}",
                       check=False)
    assert can.stdout.strip() == "yes", can
    # ...and nothing unrelated (it has no business with secrets' contents cluster-wide).
    cannot = node.kubectl("auth", "can-i", "delete", "nodes", f"--as=system:serviceaccount:{NS}:{sa}", check=False)
    assert cannot.stdout.strip() == "no", cannot
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and status["restartCount"] == 0, status
    assert status["image"].endswith(node.images["operator"].split("/", 1)[1]), status


# What a pod's log says about its start: the model converted or read from the node's cache, and how
# long loading and the whole start took (runtime/model/loader.py, runtime/server/launch.py).
STARTUP_MARKS = ("converting ", "converted ", "converted form found", "model loaded", " ready in ")


def startup_log(node: Node, pod: str) -> list[str]:
    out = node.kubectl("-n", NS, "logs", pod, "-c", "runtime", check=False).stdout
    return [line for line in out.splitlines() if any(m in line for m in STARTUP_MARKS)]


def test_b_kubectl_apply_sample_pods_become_ready(node: Node, service):
    for role, s in service["ready_s"].items():
        print(f"\n[b] apply -> {role} pod Ready: {s:.1f} s", end="")
    for role in ROLES:
        for p in node.pods(role):
            for line in startup_log(node, p["metadata"]["name"]):
                print(f"\n[b]   {role}: {line}", end="")
    for role in ROLES:
        pods = [p for p in node.pods(role) if ready(p)]
        assert len(pods) == 1 and pods[0]["spec"]["nodeName"] == "phasesplit-node", role
    # The operator sees the same and says so in the CR's status.
    t0 = time.monotonic()
    wait_until("psvc Ready", lambda: "True" in node.kubectl(
        "-n", NS, "get", "psvc", NAME, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}").stdout,
        timeout=120)
    table = node.kubectl("-n", NS, "get", "psvc", NAME).stdout
    print(f"\n[b] psvc Ready {time.monotonic() - t0:.1f} s after the last pod\n{table}")
    endpoint = node.kubectl("-n", NS, "get", "psvc", NAME, "-o", "jsonpath={.status.endpoint}").stdout
    assert f"{NAME}-router" in endpoint and endpoint in table


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The same greedy chat completion from a local colocated runtime (same model and dtype)."""
    port = free_port()
    d = tmp_path_factory.mktemp("reference")
    proc = Proc(["serve", "--role", "both", "--port", str(port), "--model", "smollm2", "--served-model-name",
                 "smollm2-135m", "--device", "cpu", "--dtype", "float32", "--max-model-len", "2048",
                 "--log-level", "warning"], d / "serve.log", url=f"http://127.0.0.1:{port}")
    try:
        proc.wait_ready(timeout=300)
        text, _, finish = chat_stream(proc.url)
        assert text and finish in ("stop", "length")
        return text
    finally:
        proc.stop()


def test_c_openai_sdk_streams_through_the_router_service(node: Node, service, reference):
    wait_served(service["url"])
    t0 = time.monotonic()
    text, ttft, finish = chat_stream(service["url"])
    total = time.monotonic() - t0
    print(f"\n[c] {service['url']} (ClusterIP via kube-proxy): TTFT {ttft * 1000:.0f} ms, "
          f"{total:.2f} s total, finish {finish}: {text!r}")
    assert finish in ("stop", "length")
    assert text == reference
    # Split for real: the prefill pod prefilled and the decode pod received its K/V. A decode worker
    # that cannot verify its prefill Service's addresses (resolved by DNS) prefills locally, with the
    # same text: only its counters tell.
    from phasesplit.runtime import metric_names as names

    ip = next(p for p in node.pods("decode") if ready(p))["status"]["podIP"]
    kv, local = metric_total(ip, names.KV_BYTES), metric_total(ip, names.LOCAL_PREFILL)
    print(f"[c] decode worker: {kv:g} KV bytes received from the prefill pod, {local:g} requests prefilled locally")
    assert kv > 0, (f"the decode worker prefilled locally ({local:g} requests) instead of using the prefill pod: "
                    "see its log for 'cannot resolve prefill service'")


def tokenizer_file(node: Node, tmp_path: Path) -> str:
    """The served model's tokenizer, for exact prompt lengths. Neither the router nor the workers
    serve /v1/tokenizer.json, so bench resolves the bundled model (the one the pods serve)."""
    return "smollm2"


def test_d_bench_60s_modest_rate_no_failures(node: Node, service, tmp_path):
    wait_served(service["url"])
    out = tmp_path / "bench.json"
    tok = tokenizer_file(node, tmp_path)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "phasesplit.runtime.cli", "bench", "--url", service["url"],
                        "--tokenizer", tok, "--model", "smollm2-135m", "--input-len", "64", "--output-len", "16", "--num-prompts", "60",
                        "--request-rate", "1", "--no-progress", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=600)
    print(f"\n[d] bench took {time.monotonic() - t0:.1f} s\n{p.stdout[-2500:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(out.read_text())["runs"][0]["summary"]
    print(f"[d] completed {s['completed']}, failed {s['failed']}; TTFT p50 {s['ttft_s']['p50'] * 1000:.0f} ms "
          f"p99 {s['ttft_s']['p99'] * 1000:.0f} ms; ITL p50 {s['itl_s']['p50'] * 1000:.1f} ms "
          f"p99 {s['itl_s']['p99'] * 1000:.1f} ms")
    assert s["completed"] == 60 and s["failed"] == 0


@dataclass
class Outcome:
    done: bool = False
    text: str = ""
    finish: str | None = None
    error: str | None = None
    took: float = 0.0


def streams_during(url: str, n: int, action: Callable[[], None], timeout: float = 90) -> tuple[list[Outcome], float]:
    """n concurrent streaming requests; `action` runs once the first tokens arrived. Each client
    must end (a completion or an error) within the timeout: never a hang."""
    import openai

    outcomes = [Outcome() for _ in range(n)]
    started = threading.Event()

    def one(o: Outcome) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)
        t0 = time.monotonic()
        try:
            for chunk in c.chat.completions.create(model="smollm2-135m", messages=PROMPT, max_tokens=200,
                                                   temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
                    o.text += chunk.choices[0].delta.content
                    started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    o.finish = chunk.choices[0].finish_reason
        except Exception as e:  # noqa: BLE001 - any error the client sees is an outcome
            o.error = f"{type(e).__name__}: {e}"[:200]
        o.took = time.monotonic() - t0
        o.done = True

    threads = [threading.Thread(target=one, args=(o,), daemon=True) for o in outcomes]
    for t in threads:
        t.start()
    assert started.wait(120), "no tokens arrived"
    t_act = time.monotonic()
    action()
    for t in threads:
        t.join(timeout + 30)
    return outcomes, time.monotonic() - t_act


def decode_pod(node: Node) -> dict[str, Any]:
    return next(p for p in node.pods("decode") if ready(p))


def replacement_serves(node: Node, url: str, old: str) -> float:
    t0 = time.monotonic()
    wait_until("a replacement decode pod Ready", lambda: any(
        ready(p) and p["metadata"]["name"] != old or
        (ready(p) and p["status"]["containerStatuses"][0]["restartCount"] > 0) for p in node.pods("decode")),
        timeout=300, interval=0.5)
    wait_served(url, timeout=120)
    return time.monotonic() - t0


@pytest.mark.parametrize("how", ["delete-pod", "kill-container"])
def test_e_decode_lost_mid_stream_clients_never_hang(node: Node, service, how):
    url = service["url"]
    wait_served(url)
    pod = decode_pod(node)
    name = pod["metadata"]["name"]

    if how == "delete-pod":
        def act() -> None:
            node.kubectl("-n", NS, "delete", "pod", name, "--wait=false")
    else:
        cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]

        def act() -> None:
            r = node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
            assert r.returncode == 0, r.stderr

    outcomes, took = streams_during(url, 4, act)
    for o in outcomes:
        print(f"\n[e:{how}] done={o.done} {o.took:.1f} s finish={o.finish} error={o.error} "
              f"tokens~{len(o.text.split())}", end="")
    assert all(o.done for o in outcomes), "a client hung"
    assert all(o.finish in ("stop", "length") or o.error for o in outcomes)
    back = replacement_serves(node, url, name)
    print(f"\n[e:{how}] all clients ended {took:.1f} s after the {how}; replacement serving "
          f"{back:.1f} s after that")
    if how == "delete-pod":
        # A new pod has a new emptyDir: only the node's model cache (spec.model.cache) spares it
        # the conversion the first pod did.
        new = next(p["metadata"]["name"] for p in node.pods("decode") if ready(p) and p["metadata"]["name"] != name)
        log = startup_log(node, new)
        print("".join(f"\n[e:{how}]   {line}" for line in log))
        assert any("converted form found" in line for line in log), f"{new} did not read the node's model cache"
        assert not any("converting " in line for line in log), f"{new} converted the model again"


def metric_total(pod_ip: str, name: str) -> float:
    page = httpx.get(f"http://{pod_ip}:8000/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_g_planner_with_pod_metrics_scales_real_pods(node: Node, service, tmp_path):
    """A load step raises a pool; the new pod serves; after the window it scales back."""
    url = service["url"]
    wait_served(url)
    # Longer than a pod's start here (~220 s on the shared 2-core node): with 30 s the planner took
    # the new pods back before they were ever Ready (its "no traffic" steps while every request
    # sat in the overloaded pods' queues ended the stabilization window at once).
    window_s = 300
    t_apply = apply_sample(node, {
        "prefill": {**yaml.safe_load(SAMPLE.read_text())["spec"]["prefill"], "minReplicas": 1, "maxReplicas": 2},
        "decode": {**yaml.safe_load(SAMPLE.read_text())["spec"]["decode"], "minReplicas": 1, "maxReplicas": 2},
        "slo": {"ttft": "300ms", "itl": "100ms", "percentile": 90},
        "autoscaling": {"mode": "Planner", "interval": "5s", "metrics": {"source": "pods"},
                        "behavior": {"scaleDown": {"stabilizationWindowSeconds": window_s}}},
    })
    def apps_replicas() -> tuple[int, ...]:
        return tuple(int(node.kubectl("-n", NS, "get", "deploy", f"{NAME}-{p}", "-o",
                                      "jsonpath={.spec.replicas}").stdout or 0) for p in ("prefill", "decode"))

    def raised_replicas() -> tuple[int, ...] | None:
        r = apps_replicas()
        return r if max(r) > 1 else None
    wait_until("a planner step with fresh metrics", lambda: "True" in node.kubectl(
        "-n", NS, "get", "psvc", NAME, "-o",
        "jsonpath={.status.autoscaling.conditions[?(@.type=='MetricsAvailable')].status}").stdout, timeout=120)
    print(f"\n[g] planner mode on, metrics read from the pods {time.monotonic() - t_apply:.1f} s after apply")
    before = {p["metadata"]["name"] for role in ("prefill", "decode") for p in node.pods(role)}
    bench = subprocess.Popen(
        [sys.executable, "-m", "phasesplit.runtime.cli", "bench", "--url", url, "--model", "smollm2-135m",
         # A gentle, long step: arrivals for 4 minutes, so that a new pod (~1-1.5 min to Ready on
         # this shared machine) still gets new requests, and a backlog that stays well inside the
         # admission limits (80 requests per decode worker: beyond them the router answers 429).
         "--tokenizer", tokenizer_file(node, tmp_path), "--input-len", "128", "--output-len", "16",
         "--num-prompts", "120", "--request-rate", "0.5",
         "--warmup", "0", "--no-progress", "--output-json", str(tmp_path / "bench.json")],
        stdout=open(tmp_path / "bench.log", "wb"), stderr=subprocess.STDOUT)
    try:
        t_load = time.monotonic()
        raised = wait_until("a scale-up", raised_replicas, timeout=180)
        t_up = time.monotonic()
        print(f"[g] scaled to (prefill, decode) = {raised} {t_up - t_load:.1f} s after the load started")
        new_pods = lambda: [p for role in ("prefill", "decode") for p in node.pods(role)  # noqa: E731
                            if ready(p) and p["metadata"]["name"] not in before]
        first = wait_until("a new pod Ready", lambda: next(iter(new_pods()), None), timeout=300, interval=0.5)
        print(f"[g] new pod {first['metadata']['name']} Ready {time.monotonic() - t_up:.1f} s after the scale-up")

        def served() -> tuple[str, str, float] | None:
            # The router sends requests to decode workers, decode workers send prompts to prefill
            # workers: whichever phase grew, its new pod must get some.
            for p in new_pods():
                role = p["metadata"]["labels"]["app.kubernetes.io/component"]
                metric = "phasesplit_request_success_total" if role == "decode" else "phasesplit_prompt_tokens_total"
                if (n := metric_total(p["status"]["podIP"], metric)) > 0:
                    return p["metadata"]["name"], metric, n
            return None
        name, metric, n = wait_until("traffic on a new pod", served, timeout=240, interval=1)
        print(f"[g] new pod {name} served ({metric} = {n:g}) {time.monotonic() - t_up:.1f} s after the scale-up")
        bench.wait(timeout=900)
        t_end = time.monotonic()
        wait_until("the scale-down to (1, 1)", lambda: apps_replicas() == (1, 1), timeout=window_s + 120)
        print(f"[g] back to (1, 1) {time.monotonic() - t_end:.1f} s after the load ended")
    finally:
        if bench.poll() is None:
            bench.kill()
        # Back to the fixed sample for any later test, pass or fail (a planner left on would keep
        # scaling the pods the next test measures).
        apply_sample(node)
    print((tmp_path / "bench.log").read_text()[-1200:])
    s = json.loads((tmp_path / "bench.json").read_text())["runs"][0]["summary"]
    print(f"[g] load step: completed {s['completed']}, failed {s['failed']}")
    assert s["failed"] == 0


ROLL_PROMPTS = ["The capital of France is", "List three prime numbers:", "Write a haiku about the sea.",
                "def fibonacci(n):", "The three primary colours are", "Once upon a time, in a small village,"]
ROLL_TOKENS = 16


def completion(url: str, prompt: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": prompt, "temperature": 0,
                                                     "max_tokens": ROLL_TOKENS, "ignore_eos": True}, timeout=timeout)


@pytest.fixture(scope="module")
def rollout_references(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Greedy texts of ROLL_PROMPTS from a local colocated runtime, per dtype (the rollout's two)."""
    refs = {}
    for dtype in ("float32", "bfloat16"):
        port = free_port()
        proc = Proc(["serve", "--role", "both", "--port", str(port), "--model", "smollm2", "--served-model-name",
                     "smollm2-135m", "--device", "cpu", "--dtype", dtype, "--max-model-len", "2048",
                     "--log-level", "warning"], tmp_path_factory.mktemp(f"ref-{dtype}") / "serve.log",
                    url=f"http://127.0.0.1:{port}")
        try:
            proc.wait_ready(timeout=300)
            refs[dtype] = {p: completion(proc.url, p).json()["choices"][0]["text"] for p in ROLL_PROMPTS}
        finally:
            proc.stop()
    return refs


def internal_headers(node: Node) -> dict[str, str]:
    """The service's internal secret (the test is cluster admin), to read workers' /internal/state."""
    import base64

    from phasesplit.operator.render import INTERNAL_SECRET_KEY
    from phasesplit.runtime import internal_secret

    raw = node.kubectl("-n", NS, "get", "secret", f"{NAME}-internal", "-o",
                       f"jsonpath={{.data.{INTERNAL_SECRET_KEY}}}").stdout
    return {internal_secret.HEADER: base64.b64decode(raw).decode()}


def test_f_rolling_update_of_a_kv_relevant_arg_never_mixes_revisions(node: Node, service, rollout_references):
    """dtype float32 -> bfloat16 under load: the prefill, decode (and router) Deployments roll,
    old and new pairs serve side by side, and every greedy output equals one revision's reference."""
    from phasesplit.operator.render import REVISION_LABEL
    from phasesplit.runtime import metric_names as names

    url = service["url"]
    wait_served(url)
    refs = rollout_references
    telling = [p for p in ROLL_PROMPTS if refs["float32"][p] != refs["bfloat16"][p]]
    print(f"\n[f] {len(telling)} of {len(ROLL_PROMPTS)} prompts tell the two revisions apart by their output")
    old_rev = {p["metadata"]["labels"][REVISION_LABEL] for p in node.pods("decode") if ready(p)}
    assert len(old_rev) == 1, old_rev
    hdrs = internal_headers(node)
    rollout_error: str | None = None
    results: list[tuple[str, float, int | None, str]] = []  # prompt, time, status, text or error
    kv_state: dict[str, dict] = {}  # pod -> its last /internal/state
    kv_bytes: dict[tuple[str, str], float] = {}  # (revision, pod) -> K/V bytes it received from prefill pods
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            prompt = ROLL_PROMPTS[i % len(ROLL_PROMPTS)]
            i += 1
            try:
                r = completion(url, prompt, timeout=600)  # a client that waits: failures, not patience
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:300]
                results.append((prompt, time.monotonic(), r.status_code, text))
            except (httpx.HTTPError, ValueError, KeyError) as e:
                results.append((prompt, time.monotonic(), None, f"{type(e).__name__}: {e}"[:300]))

    def watch() -> None:
        while not stop.is_set():
            for p in node.pods("decode"):
                ip = (p.get("status") or {}).get("podIP")
                if ip and ready(p):
                    try:
                        kv_state[p["metadata"]["name"]] = httpx.get(f"http://{ip}:8000/internal/state",
                                                                     headers=hdrs, timeout=5).json()
                        key = (p["metadata"]["labels"][REVISION_LABEL], p["metadata"]["name"])
                        kv_bytes[key] = metric_total(ip, names.KV_BYTES)
                    except (httpx.HTTPError, ValueError):
                        pass
            stop.wait(2)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(2)]
    threads.append(threading.Thread(target=watch, daemon=True))
    for t in threads:
        t.start()
    try:
        time.sleep(10)  # load before the rollout
        sample_runtime = yaml.safe_load(SAMPLE.read_text())["spec"]["runtime"]
        t_apply = apply_sample(node, {"runtime": {**sample_runtime, "dtype": "bfloat16"}})

        def rolled() -> str | None:
            revs = set()
            for role in ("prefill", "decode"):
                pods = node.pods(role)
                if len(pods) != 1 or not ready(pods[0]):
                    return None
                revs.add(pods[0]["metadata"]["labels"][REVISION_LABEL])
            return revs.pop() if len(revs) == 1 and revs != old_rev else None
        try:
            new_rev = wait_until("the rollout: one Ready prefill and decode pod, of the new revision", rolled,
                                 timeout=1200, interval=1)
        except pytest.fail.Exception as e:  # still report what the clients saw meanwhile
            rollout_error, t_rolled = str(e), float("inf")
        else:
            t_rolled = time.monotonic()
            print(f"[f] revision {old_rev.pop()} -> {new_rev}: rolled {t_rolled - t_apply:.1f} s after the apply")
            wait_served(url)
            time.sleep(15)  # the new pair under load
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    by = {"old": 0, "new": 0, "both": 0, "neither": 0, "failed": 0}
    wrong = []
    for prompt, _, status, text in results:
        if status != 200:
            by["failed"] += 1
            wrong.append((prompt, status, text))
            continue
        a, b = text == refs["float32"][prompt], text == refs["bfloat16"][prompt]
        key = "both" if a and b else "old" if a else "new" if b else "neither"
        by[key] += 1
        if key == "neither":
            wrong.append((prompt, status, text))
    new_after = sum(1 for p, t, s, x in results if t > t_rolled and s == 200 and p in telling
                    and x == refs["bfloat16"][p])
    mismatched = sum(s.get("kv_mismatched", 0) for s in kv_state.values())
    print(f"[f] {len(results)} requests: {by}; {new_after} telling ones served by the new revision after the "
          f"rollout; KV handshakes refused for another layout: {mismatched} "
          f"(over {len(kv_state)} decode pods)")
    for w in wrong[:5]:
        print(f"[f]   {w}")
    for (rev, pod), n in sorted(kv_bytes.items()):
        print(f"[f]   decode pod {pod} (revision {rev}): {n:g} K/V bytes received from prefill pods")
    assert by["neither"] == 0, "an output matched neither revision: a request mixed them"
    assert rollout_error is None, rollout_error
    assert by["failed"] == 0, f"{by['failed']} requests failed during the rollout"
    assert mismatched == 0, "the router paired a decode worker with a prefill worker of another layout"
    assert not telling or new_after > 0, "the new revision never served"
    # The pairing was exercised: the new revision's decode pod took K/V from a prefill pod (of its
    # revision, or the handshake would have been refused above), not only local prefills.
    assert any(n > 0 for (rev, _), n in kv_bytes.items() if rev == new_rev), \
        f"the new revision's decode pod received no K/V from a prefill pod: {kv_bytes}"


def test_h_uninstall_and_delete_leave_nothing(node: Node, service):
    pods = node.pods()
    uids = [p["metadata"]["uid"] for p in pods]
    t0 = time.monotonic()
    node.kubectl("-n", NS, "delete", "psvc", NAME, "--wait=true", "--timeout=120s")
    subprocess.run(["helm", "uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "2m"], check=True,
                   env=node.cluster.env, capture_output=True, timeout=200)
    wait_until("every pod gone", lambda: not json.loads(node.kubectl(
        "-n", NS, "get", "pods", "-o", "json").stdout)["items"], timeout=180, interval=0.5)
    wait_until("no containers or sandboxes left in containerd",
               lambda: not node.ctr("containers", "ls", "-q").stdout.split(), timeout=120, interval=0.5)
    assert not node.ctr("tasks", "ls", "-q").stdout.split()
    # The kubelet removes each pod's cgroup (cgroupfs driver: kubepods/<qos>/pod<uid>).
    def leftover_cgroups() -> list[str]:
        return [str(p) for uid in uids for p in Path("/sys/fs/cgroup").glob(f"*/phasesplit-node/**/pod{uid}")]
    wait_until("the pods' cgroups removed", lambda: not leftover_cgroups(), timeout=120, interval=1)
    print(f"\n[h] psvc delete + helm uninstall -> no pod, container or cgroup: {time.monotonic() - t0:.1f} s")
