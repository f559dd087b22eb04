"""The local control plane is a real one: the behaviour the operator relies on happens for real.

Controllers turn a Deployment into a ReplicaSet and Pods, the scheduler places GPU pods on the
fake GPU nodes, kwok (standing in for the kubelet) makes them Running and Ready, the garbage
collector removes owned objects, the API server enforces a CRD's CEL rules, ServiceAccount tokens
can be requested and verified, and the cached kubectl and helm talk to it.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests import waiting
from tests.kubecluster import CLUSTER_SH, KubeCluster

pytestmark = pytest.mark.cluster

T = TypeVar("T")
GPU = "nvidia.com/gpu"


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.25) -> T:
    return waiting.wait_until(what, probe, timeout, interval)


@pytest.fixture
def namespace(kube_cluster: KubeCluster) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (the namespace controller empties it)."""
    name = f"cp-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(kube_cluster.api_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    # Pods are admitted only once the namespace's `default` ServiceAccount exists.
    wait_until(
        f"ServiceAccount {name}/default",
        lambda: core.list_namespaced_service_account(name, field_selector="metadata.name=default").items,
    )
    yield name
    core.delete_namespace(name)


def gpu_deployment(name: str, replicas: int) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "worker",
                            # Never pulled: kwok plays the kubelet and runs no containers.
                            "image": "registry.invalid/phasesplit/worker:test",
                            "resources": {"limits": {GPU: "1", "cpu": "1", "memory": "1Gi"}},
                        }
                    ]
                },
            },
        },
    }


def test_deployment_gpu_pods_run_on_fake_gpu_nodes_and_gc_removes_them(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    apps = client.AppsV1Api(kube_cluster.api_client)
    core = client.CoreV1Api(kube_cluster.api_client)
    name = "gpu-worker"
    kube_cluster.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(gpu_deployment(name, 2)))

    # The deployment controller creates a ReplicaSet it owns...
    rs = wait_until(
        "the Deployment's ReplicaSet",
        lambda: apps.list_namespaced_replica_set(namespace, label_selector=f"app={name}").items,
    )
    assert len(rs) == 1
    owner = rs[0].metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller) == ("Deployment", name, True)

    # ...the ReplicaSet controller creates two Pods, the scheduler binds them to GPU nodes and kwok
    # reports them Running and Ready.
    def ready_pods() -> list[client.V1Pod] | None:
        pods = core.list_namespaced_pod(namespace, label_selector=f"app={name}").items
        ok = [
            p
            for p in pods
            if p.status.phase == "Running"
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        ]
        return ok if len(ok) == 2 and len(pods) == 2 else None

    pods = wait_until("2 Running and Ready pods", ready_pods, timeout=90)
    gpu_nodes = {
        n.metadata.name: n
        for n in core.list_node(label_selector="nvidia.com/gpu.present=true").items
        if int(n.status.allocatable.get(GPU, "0")) > 0
    }
    assert len(gpu_nodes) == 2
    for pod in pods:
        assert pod.spec.node_name in gpu_nodes, pod.spec.node_name
        assert pod.metadata.owner_references[0].kind == "ReplicaSet"
        assert pod.metadata.owner_references[0].name == rs[0].metadata.name
        assert pod.spec.containers[0].resources.requests[GPU] == "1"  # defaulted from the limit
        assert pod.status.pod_ip  # kwok hands out pod IPs from its CIDR
    wait_until(
        "the Deployment to report 2 available replicas",
        lambda: (apps.read_namespaced_deployment_status(name, namespace).status.available_replicas or 0) == 2,
    )

    # Deleting the Deployment alone leaves its dependents to the garbage collector.
    apps.delete_namespaced_deployment(
        name, namespace, body=client.V1DeleteOptions(propagation_policy="Background")
    )
    wait_until(
        "the garbage collector to remove the ReplicaSet and Pods",
        lambda: (
            not apps.list_namespaced_replica_set(namespace, label_selector=f"app={name}").items
            and not core.list_namespaced_pod(namespace, label_selector=f"app={name}").items
        ),
        timeout=90,
    )


def test_gpu_capacity_is_enforced_by_the_scheduler(kube_cluster: KubeCluster, namespace: str) -> None:
    """16 fake GPUs in all: a 17th single-GPU pod stays Pending as Insufficient nvidia.com/gpu."""
    core = client.CoreV1Api(kube_cluster.api_client)
    total = sum(
        int(n.status.allocatable.get(GPU, "0")) for n in core.list_node(label_selector="type=kwok").items
    )
    assert total == 16
    name = "gpu-hog"
    kube_cluster.kubectl(
        "-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(gpu_deployment(name, total + 1))
    )

    def placed() -> tuple[int, list[client.V1Pod]] | None:
        pods = core.list_namespaced_pod(namespace, label_selector=f"app={name}").items
        running = sum(p.status.phase == "Running" for p in pods)
        pending = [
            p
            for p in pods
            if any(
                c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
                for c in p.status.conditions or []
            )
        ]
        return (running, pending) if running == total and len(pending) == 1 else None

    _, pending = wait_until(f"{total} running pods and 1 unschedulable", placed, timeout=120)
    message = next(c.message for c in pending[0].status.conditions if c.type == "PodScheduled")
    assert f"Insufficient {GPU}" in message


CRD_GROUP = "cel.phasesplit.test"


def test_crd_cel_rule_rejects_violating_object(kube_cluster: KubeCluster) -> None:
    plural = f"ranges{uuid.uuid4().hex[:6]}"
    rule_message = "minReplicas must not exceed maxReplicas"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{CRD_GROUP}"},
        "spec": {
            "group": CRD_GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural[:-1], "kind": plural.capitalize()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["minReplicas", "maxReplicas"],
                                    "properties": {
                                        "minReplicas": {"type": "integer", "minimum": 0},
                                        "maxReplicas": {"type": "integer", "minimum": 0},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.minReplicas <= self.maxReplicas",
                                            "message": rule_message,
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    kube_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(crd))
    try:
        kube_cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{plural}.{CRD_GROUP}", "--timeout=60s"
        )
        custom = client.CustomObjectsApi(kube_cluster.api_client)

        def obj(name: str, lo: int, hi: int) -> dict:
            return {
                "apiVersion": f"{CRD_GROUP}/v1",
                "kind": plural.capitalize(),
                "metadata": {"name": name},
                "spec": {"minReplicas": lo, "maxReplicas": hi},
            }

        # The discovery of a new CRD can lag its Established condition by a moment.
        wait_until(
            "the new CRD to serve objects",
            lambda: kube_cluster.kubectl("-n", "default", "get", plural, check=False).returncode == 0,
        )
        custom.create_namespaced_custom_object(CRD_GROUP, "v1", "default", plural, obj("good", 1, 3))

        with pytest.raises(ApiException) as rejected:
            custom.create_namespaced_custom_object(CRD_GROUP, "v1", "default", plural, obj("bad", 5, 2))
        assert rejected.value.status == 422
        assert rule_message in json.loads(rejected.value.body)["message"]

        # kubectl shows users the same message.
        cli = kube_cluster.kubectl(
            "-n", "default", "create", "-f", "-", input=yaml.safe_dump(obj("bad2", 4, 1)), check=False
        )
        assert cli.returncode != 0
        assert rule_message in cli.stderr

        # Updates are validated too.
        with pytest.raises(ApiException) as rejected_update:
            custom.patch_namespaced_custom_object(
                CRD_GROUP, "v1", "default", plural, "good", {"spec": {"minReplicas": 9}}
            )
        assert rule_message in json.loads(rejected_update.value.body)["message"]
    finally:
        kube_cluster.kubectl("delete", "crd", f"{plural}.{CRD_GROUP}", "--wait=false", check=False)


def test_service_account_tokens_can_be_requested_and_verified(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    """The operator's tests mint tokens with TokenRequest; the API server must accept them back."""
    core = client.CoreV1Api(kube_cluster.api_client)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="op"))
    )
    token = core.create_namespaced_service_account_token(
        "op", namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
    ).status.token
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert claims["iss"] == "https://kubernetes.default.svc.cluster.local"

    review = client.AuthenticationV1Api(kube_cluster.api_client).create_token_review(
        client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token))
    )
    assert review.status.authenticated
    assert review.status.user.username == f"system:serviceaccount:{namespace}:op"

    # Used as a bearer token it authenticates as the ServiceAccount, whose RBAC grants nothing yet.
    admin = kube_cluster.api_client.configuration
    cfg = client.Configuration()
    cfg.host, cfg.ssl_ca_cert = admin.host, admin.ssl_ca_cert
    cfg.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(cfg) as as_sa:
        with pytest.raises(ApiException) as forbidden:
            client.CoreV1Api(as_sa).list_namespaced_pod(namespace)
        assert forbidden.value.status == 403
        assert f"system:serviceaccount:{namespace}:op" in json.loads(forbidden.value.body)["message"]

    # The root CA publisher puts the cluster CA into every namespace, as pods expect.
    wait_until(
        "the kube-root-ca.crt ConfigMap",
        lambda: (
            core.list_namespaced_config_map(namespace, field_selector="metadata.name=kube-root-ca.crt").items
        ),
    )


def test_cached_kubectl_and_helm_work_against_the_cluster(kube_cluster: KubeCluster) -> None:
    bin_dir = Path(kube_cluster.bin_dir)
    versions = dict(
        line.split("=", 1) for line in (bin_dir.parent / "versions").read_text().split() if "=" in line
    )

    nodes = kube_cluster.kubectl("get", "nodes", "-l", "type=kwok", "-o", "name").stdout.split()
    assert sorted(nodes) == ["node/kwok-gpu-0", "node/kwok-gpu-1"]
    table = kube_cluster.kubectl("get", "nodes").stdout
    assert table.count(" Ready ") == 2, table

    version = json.loads(kube_cluster.kubectl("version", "-o", "json").stdout)
    # A real version (not v0.0.0-master): Helm's kubeVersion constraints depend on it.
    assert version["serverVersion"]["gitVersion"] == versions["kubernetes"]
    assert version["clientVersion"]["gitVersion"] == versions["kubernetes"]

    helm = str(bin_dir / "helm")
    short = subprocess.run(
        [helm, "version", "--short"], capture_output=True, text=True, env=kube_cluster.env, check=True
    )
    assert short.stdout.startswith(versions["helm"]), short.stdout
    # helm reaches the API server too (it lists release Secrets in every namespace).
    listed = subprocess.run(
        [helm, "list", "--all-namespaces", "-o", "json"],
        capture_output=True,
        text=True,
        env=kube_cluster.env,
        check=True,
    )
    assert json.loads(listed.stdout) == []


def test_cluster_sh_up_reuses_the_running_cluster(kube_cluster: KubeCluster) -> None:
    t0 = time.monotonic()
    again = subprocess.run(["bash", str(CLUSTER_SH), "up"], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert again.returncode == 0, again.stderr
    assert "reusing the running cluster" in again.stderr
    assert f"export KUBECONFIG={kube_cluster.kubeconfig}" in again.stdout.splitlines()
    assert f"export PATH={kube_cluster.bin_dir}:$PATH" in again.stdout.splitlines()
    assert elapsed < 30, elapsed
    assert os.path.samefile(kube_cluster.kubeconfig, again.stdout.split("KUBECONFIG=", 1)[1].split()[0])


def test_cluster_sh_down_refuses_while_test_sessions_use_it(kube_cluster: KubeCluster) -> None:
    """This session holds the cluster's users lock, so a plain `down` must leave it running."""
    refused = subprocess.run(["bash", str(CLUSTER_SH), "down"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "test sessions are using the cluster" in refused.stderr
    assert kube_cluster.kubectl("get", "--raw", "/readyz").stdout == "ok"
