"""The operator at scale on the local control plane (issue 14, acceptance 5).

    eval "$(hack/cluster.sh up)"
    ~/.cache/phasesplit/venv/bin/python tests/bench/operator_scale.py [--count 1000] [--stopped-count 100]

1. Adds fake (kwok) nodes with room for every pod, a fresh namespace, and starts
   `phasesplit operator --namespace NS` as a local process (the cluster admin's kubeconfig).
2. Creates COUNT minimal InferenceServices (default autoscaling: Planner mode) at once, from 16
   threads, and waits (--timeout) until every one is Ready (condition Ready=True at its
   generation), watching the Deployments too: when every child was applied, when every
   Deployment was ready (the control plane's own work), how long each service's Ready trailed
   its Deployments (the operator's share).
3. Load-insensitive figures from the first create to all Ready: the operator's CPU-seconds (per
   service) and the control plane's per component (hack/cluster.sh's pids), whose sum over the
   machine's cores bounds "all Ready" from below; then, once everything is Ready, the peak RSS
   (VmHWM) and the CPU cores used and log lines written over --idle seconds.
4. Deletes the namespace with the operator running and times it to the namespace's end; then
   the same for --stopped-count services (once their children are applied) with the operator
   killed first (no finalizer: it must not hang).
Prints one JSON object with the figures (and a table on stderr). Removes its nodes at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"model": {"name": "smollm2-135m", "builtin": "smollm2"}, "prefill": {"replicas": 1},
           "decode": {"replicas": 2}}
GROUP, VERSION, PLURAL = "serving.phasesplit.io", "v1alpha1", "inferenceservices"
PODS_PER_NODE = 500
INSTANCE_LABEL = "app.kubernetes.io/instance"
CONTROL_PLANE = ("kube-apiserver", "kube-controller-manager", "etcd", "kube-scheduler", "kwok")


def say(msg: str) -> None:
    print(f"[operator-scale] {msg}", file=sys.stderr, flush=True)


def nodes(n: int, tag: str) -> list[dict[str, Any]]:
    res = {"cpu": "1000", "memory": "4Ti", "pods": str(PODS_PER_NODE), "nvidia.com/gpu": "64"}
    return [{"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": f"kwok-bench-{tag}-{i}", "annotations": {"kwok.x-k8s.io/node": "fake"},
                          "labels": {"type": "kwok", "bench": tag, "kubernetes.io/os": "linux"}},
             "status": {"capacity": res, "allocatable": res}} for i in range(n)]


class Proc:
    """/proc figures of one process."""

    def __init__(self, pid: int):
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / self.tick

    def status(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)


def start_operator(kubeconfig: str, namespace: str, log: Path) -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = open(log, "a")
    proc = subprocess.Popen([sys.executable, "-m", "phasesplit.runtime.cli", "operator", f"--namespace={namespace}",
                             f"--leader-election-namespace={namespace}",
                             f"--liveness=http://127.0.0.1:{port}/healthz"],
                            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=dict(os.environ, KUBECONFIG=kubeconfig, PYTHONUNBUFFERED="1"))
    import urllib.request

    deadline = time.monotonic() + 180  # a loaded machine, or a profiler, slows the imports
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the operator exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    proc.wait()
    raise SystemExit(f"the operator did not come up in 180 s; see {log}")


def create_all(custom: client.CustomObjectsApi, namespace: str, names: list[str]) -> None:
    def one(name: str) -> None:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name},
                "spec": MINIMAL}
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, names))


def service_ready(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    cond = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), None)
    return bool(cond and cond["status"] == "True" and st.get("observedGeneration") == obj["metadata"]["generation"])


def deployment_ready(obj: dict[str, Any]) -> bool:
    """Settled at its spec: what the operator's status waits for (status.component_state)."""
    spec, st, meta = obj.get("spec") or {}, obj.get("status") or {}, obj["metadata"]
    want = spec.get("replicas", 1)
    return ((st.get("observedGeneration") or 0) >= (meta.get("generation") or 0)
            and (st.get("readyReplicas") or 0) >= want and (st.get("updatedReplicas") or 0) >= want
            and (st.get("replicas") or 0) <= want)


class Tracker:
    """Watches one kind in the namespace (plain JSON, no model classes) and notes when each
    object first became ready, grouped by service (a Deployment by its instance label)."""

    def __init__(self, list_func: Any, namespace: str, ready: Any, group: Any, t0: float):
        self.list_func, self.namespace, self.ready, self.group, self.t0 = list_func, namespace, ready, group, t0
        self.ready_at: dict[str, dict[str, float]] = {}  # group -> object name -> seconds from t0
        self.seen: dict[str, set[str]] = {}
        self._watch = watch.Watch()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # LIST, then WATCH from its resourceVersion, again from the last one seen whenever the
        # server ends the stream (and a fresh LIST if that version is gone).
        rv = None
        while not self._stopped:
            try:
                if rv is None:
                    listed = json.loads(self.list_func(self.namespace, _preload_content=False).data)
                    for obj in listed["items"]:
                        self._note(obj)
                    rv = listed["metadata"]["resourceVersion"]
                for event in self._watch.stream(self.list_func, self.namespace, resource_version=rv,
                                                allow_watch_bookmarks=True, timeout_seconds=60, deserialize=False):
                    obj = event.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._note(obj)
            except client.ApiException as e:
                if e.status != 410:
                    say(f"watch on {self.namespace}: {e.status} {e.reason}")
                    time.sleep(1)
                rv = None
            except Exception as e:  # noqa: BLE001 - the namespace went away, or the bench is ending
                if not self._stopped:
                    say(f"watch on {self.namespace}: {e!r}")
                    time.sleep(1)

    def _note(self, obj: dict[str, Any]) -> None:
        key, name = self.group(obj), obj["metadata"]["name"]
        self.seen.setdefault(key, set()).add(name)
        if self.ready(obj):
            self.ready_at.setdefault(key, {}).setdefault(name, round(time.monotonic() - self.t0, 1))

    def done_at(self, per_group: int) -> dict[str, float]:
        """Seconds until every one of a group's per_group objects was ready, per group."""
        return {k: max(v.values()) for k, v in list(self.ready_at.items()) if len(v) >= per_group}

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()


def wait_ready(custom: client.CustomObjectsApi, namespace: str, count: int, timeout: float,
               t0: float | None = None, figures: dict[str, Any] | None = None, until: str | None = None) -> float | None:
    """Seconds from t0 until every service is Ready. With figures: when the operator had applied
    every child (all Deployments exist), when every Deployment was ready (what the control
    plane's own controllers, scheduler and kwok deliver), and how long each service's Ready
    trailed its Deployments' (the operator's share of the wait)."""
    t0 = time.monotonic() if t0 is None else t0

    def list_services(ns: str, **kwargs: Any) -> Any:
        return custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, **kwargs)

    # Both watches start after the creates (and replay what exists as ADDED): times are from t0.
    services = Tracker(list_services, namespace, service_ready, lambda o: o["metadata"]["name"], t0)
    deployments = Tracker(client.AppsV1Api().list_namespaced_deployment, namespace, deployment_ready,
                          lambda o: (o["metadata"].get("labels") or {}).get(INSTANCE_LABEL, ""), t0)
    last, said = -1, set()
    try:
        while time.monotonic() - t0 < timeout:
            applied = sum(len(v) for v in list(deployments.seen.values()))
            ready_deployments = sum(len(v) for v in list(deployments.ready_at.values()))
            if figures is not None:
                for what, n in (("children_applied_s", applied), ("deployments_ready_s", ready_deployments)):
                    if n >= 3 * count and what not in figures:
                        figures[what] = round(time.monotonic() - t0, 1)
            if until is not None and figures is not None and until in figures:
                return time.monotonic() - t0
            n = len(services.done_at(1))
            if n != last or int(time.monotonic() - t0) // 30 not in said:
                said.add(int(time.monotonic() - t0) // 30)
                say(f"after {time.monotonic() - t0:.0f} s: {applied}/{3 * count} Deployments exist, "
                    f"{ready_deployments} ready; {n}/{count} services Ready")
                last = n
            if n == count:
                if figures is not None:
                    ready = services.done_at(1)
                    lags = sorted(ready[k] - d for k, d in deployments.done_at(3).items() if k in ready)
                    if lags:
                        figures["ready_lag_s"] = {"p50": round(lags[len(lags) // 2], 1),
                                                  "p90": round(lags[int(len(lags) * 0.9)], 1),
                                                  "max": round(lags[-1], 1)}
                return time.monotonic() - t0
            time.sleep(1)
        return None
    finally:
        services.stop()
        deployments.stop()


def delete_namespace(core: client.CoreV1Api, namespace: str, timeout: float) -> float | None:
    t0 = time.monotonic()
    core.delete_namespace(namespace)
    while time.monotonic() - t0 < timeout:
        try:
            core.read_namespace(namespace)
        except client.ApiException as e:
            if e.status == 404:
                return time.monotonic() - t0
            raise
        time.sleep(1)
    return None


def make_namespace(core: client.CoreV1Api, name: str) -> None:
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    for _ in range(120):
        if core.list_namespaced_service_account(name, field_selector="metadata.name=default").items:
            return
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=1000, help="InferenceServices applied at once")
    ap.add_argument("--stopped-count", type=int, default=100,
                    help="InferenceServices in the namespace deleted while the operator is stopped")
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of idle measurement once all are Ready")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds to wait for all Ready (the figures are taken then either way)")
    ap.add_argument("--delete-timeout", type=float, default=900.0, help="seconds to wait for a namespace to go")
    ap.add_argument("--log", default="/tmp/operator-scale.log", help="the operator's log")
    args = ap.parse_args()
    # SIGTERM ends the run through the cleanup below (the operator stopped, the nodes removed).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig:
        raise SystemExit('KUBECONFIG is not set: eval "$(hack/cluster.sh up)" first')
    config.load_kube_config(kubeconfig)
    core, custom = client.CoreV1Api(), client.CustomObjectsApi()
    subprocess.run(["kubectl", "apply", "--server-side", "--force-conflicts", "-f",
                    str(ROOT / "crds" / f"{GROUP}_{PLURAL}.yaml")], check=True, capture_output=True)
    tag = uuid.uuid4().hex[:6]
    pods = 4 * max(args.count, args.stopped_count)
    fake = nodes(-(-pods // PODS_PER_NODE) + 1, tag)
    for node in fake:
        core.create_node(node)
    log = Path(args.log)
    log.write_text("")
    figures: dict[str, Any] = {"count": args.count, "stopped_count": args.stopped_count}
    operator = None
    try:
        # kwok marks its nodes Ready; the node lifecycle controller then lifts the not-ready taint.
        for _ in range(120):
            listed = core.list_node(label_selector=f"bench={tag}").items
            if all(not n.spec.taints and any(c.type == "Ready" and c.status == "True"
                                             for c in n.status.conditions or []) for n in listed):
                break
            time.sleep(1)
        ns = f"scale-{tag}"
        make_namespace(core, ns)
        operator = start_operator(kubeconfig, ns, log)
        proc = Proc(operator.pid)
        names = [f"svc{i:04d}" for i in range(args.count)]
        plane = control_plane(kubeconfig)
        say(f"creating {args.count} InferenceServices in {ns} (operator pid {operator.pid})")
        figures["loadavg_before"] = loadavg()
        cpu_before = {name: p.cpu_s() for name, p in plane.items()}
        operator_before = proc.cpu_s()
        t0 = time.monotonic()
        create_all(custom, ns, names)
        figures["create_s"] = round(time.monotonic() - t0, 1)
        took = wait_ready(custom, ns, args.count, args.timeout, t0, figures)
        figures["all_ready_s"] = round(time.monotonic() - t0, 1) if took is not None else None
        figures["loadavg_at_ready"] = loadavg()
        # Load-insensitive figures: CPU-seconds from the first create to all Ready (or timeout).
        spent = round(proc.cpu_s() - operator_before, 1)
        figures["operator_cpu_s"] = spent
        figures["operator_cpu_ms_per_service"] = round(1000 * spent / args.count, 1)
        figures["control_plane_cpu_s"] = {name: round(p.cpu_s() - cpu_before[name], 1) for name, p in plane.items()}
        total = sum(figures["control_plane_cpu_s"].values())
        # What the control plane alone needs for COUNT services on this machine's cores.
        figures["control_plane_bound_s"] = round(total / (os.cpu_count() or 1), 1)
        figures["peak_rss_mb_at_ready"] = round(proc.status("VmHWM") / 2**20, 1)
        say(f"figures so far: {json.dumps(figures)}")
        time.sleep(10)  # the last status writes and Events settle
        cpu0, lines0, w0 = proc.cpu_s(), len(log.read_text().splitlines()), time.monotonic()
        time.sleep(args.idle)
        wall = time.monotonic() - w0
        figures["idle_cores"] = round((proc.cpu_s() - cpu0) / wall, 3)
        figures["idle_log_lines_per_s"] = round((len(log.read_text().splitlines()) - lines0) / wall, 2)
        figures["peak_rss_mb"] = round(proc.status("VmHWM") / 2**20, 1)
        say(f"deleting namespace {ns} with the operator running")
        figures["delete_running_s"] = _round(delete_namespace(core, ns, args.delete_timeout))
        say(f"figures so far: {json.dumps(figures)}")

        if not args.stopped_count:
            return report(figures)
        ns2 = f"scale-{tag}-stopped"
        stopped: dict[str, Any] = {}
        make_namespace(core, ns2)
        operator.send_signal(signal.SIGTERM)
        operator.wait(timeout=60)
        operator = start_operator(kubeconfig, ns2, log)
        create_all(custom, ns2, [f"svc{i:04d}" for i in range(args.stopped_count)])
        # Every child applied is enough: what is tested is that nothing waits on the operator.
        wait_ready(custom, ns2, args.stopped_count, args.timeout, figures=stopped, until="children_applied_s")
        operator.send_signal(signal.SIGKILL)
        operator.wait()
        operator = None
        say(f"deleting namespace {ns2} with the operator stopped")
        figures["delete_stopped_s"] = _round(delete_namespace(core, ns2, args.delete_timeout))
    finally:
        if operator is not None:
            operator.send_signal(signal.SIGTERM)
            operator.wait(timeout=60)
        for node in fake:
            try:
                core.delete_node(node["metadata"]["name"])
            except client.ApiException:
                pass
    return report(figures)


def report(figures: dict[str, Any]) -> int:
    say(" ".join(f"{k}={v}" for k, v in figures.items()))
    print(json.dumps(figures))
    return 0


def loadavg() -> list[float]:
    return [round(x, 1) for x in os.getloadavg()]


def control_plane(kubeconfig: str) -> dict[str, Proc]:
    """The local control plane's processes (hack/cluster.sh keeps their pids beside the kubeconfig)."""
    pids = Path(kubeconfig).parent / "pids"
    out = {}
    for name in CONTROL_PLANE:
        try:
            out[name] = Proc(int((pids / name).read_text()))
        except (OSError, ValueError):
            say(f"no pid of {name} in {pids}: its CPU is not counted")
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


if __name__ == "__main__":
    sys.exit(main())
