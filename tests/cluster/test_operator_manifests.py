"""The chart lints clean, manifests/install.yaml is the chart rendered, and the API server accepts it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.kubecluster import KubeCluster

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "phasesplit"


def _helm(cluster: KubeCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([os.path.join(cluster.bin_dir, "helm"), *args], capture_output=True, text=True,
                          env=cluster.env, cwd=ROOT, timeout=120)


def test_helm_lint_is_clean(kube_cluster: KubeCluster):
    for values in ([], ["--set", "watchNamespace=team-a"]):
        out = _helm(kube_cluster, "lint", "--strict", str(CHART), *values)
        print(out.stdout)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "0 chart(s) failed" in out.stdout


def test_values_schema_rejects_bad_values(kube_cluster: KubeCluster):
    out = _helm(kube_cluster, "template", "x", str(CHART), "--set", "logLevel=chatty")
    assert out.returncode != 0 and "logLevel" in out.stderr


def test_install_yaml_is_the_rendered_chart(kube_cluster: KubeCluster):
    env = dict(kube_cluster.env, HELM=os.path.join(kube_cluster.bin_dir, "helm"))
    committed = (ROOT / "manifests" / "install.yaml").read_text()
    out = subprocess.run(["bash", str(ROOT / "hack" / "gen-operator.sh")], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    regenerated = (ROOT / "manifests" / "install.yaml").read_text()
    assert regenerated == committed, "manifests/install.yaml is stale: run hack/gen-operator.sh and commit"


def test_install_yaml_is_accepted_by_the_api_server(kube_cluster: KubeCluster):
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "install.yaml").read_text()) if d]
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "Namespace",
                     "Role", "RoleBinding", "Service", "ServiceAccount"]
    # A server dry run does not create the Namespace, so the namespaced objects need it to exist.
    if kube_cluster.kubectl("get", "namespace", "phasesplit-system", check=False).returncode != 0:
        kube_cluster.kubectl("create", "namespace", "phasesplit-system")
    out = kube_cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                               "-f", str(ROOT / "manifests" / "install.yaml"))
    assert out.returncode == 0


def test_namespaced_install_renders_a_role_and_the_flag(kube_cluster: KubeCluster):
    out = _helm(kube_cluster, "template", "ps", str(CHART), "-n", "ops", "--set", "watchNamespace=team-a",
                "--kube-version", "1.30.0")
    assert out.returncode == 0, out.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    role = docs[("Role", "ps-phasesplit")]
    assert role["metadata"]["namespace"] == "team-a"
    assert docs[("RoleBinding", "ps-phasesplit")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "ps-phasesplit", "namespace": "ops"}]
    assert ("ClusterRole", "ps-phasesplit") not in docs  # only the read-only CRD reader stays cluster-wide
    assert docs[("ClusterRole", "ps-phasesplit-crd-reader")]["rules"][0]["verbs"] == ["get", "list", "watch"]
    args = docs[("Deployment", "ps-phasesplit")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args
    cluster_wide = [d for d in yaml.safe_load_all(_helm(kube_cluster, "template", "ps", str(CHART), "-n", "ops",
                                                        "--kube-version", "1.30.0").stdout) if d]
    # Cluster-wide, the only Role is leader election's: Leases, in the operator's own namespace.
    roles = [d for d in cluster_wide if d["kind"] == "Role"]
    assert [(r["metadata"]["name"], r["metadata"]["namespace"]) for r in roles] == [("ps-phasesplit-leader-election", "ops")]
    assert roles[0]["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                  "verbs": ["get", "create", "update"]}]
    # Both modes: the Lease namespace comes from the pod's own.
    env = docs[("Deployment", "ps-phasesplit")]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in env
