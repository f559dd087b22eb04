"""The router's worker discovery follows EndpointSlices on a real API server.

Only the watch runs here (no poller), so the made-up pod addresses are never contacted.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from kubernetes import client

from phasesplit.runtime.server.router import watch_kubernetes
from phasesplit.runtime.server.routing import Pool

pytestmark = pytest.mark.cluster


def _slice(name: str, service: str, ips: list[str], ready: bool = True) -> client.V1EndpointSlice:
    return client.V1EndpointSlice(
        metadata=client.V1ObjectMeta(name=name, labels={"kubernetes.io/service-name": service}),
        address_type="IPv4",
        ports=[client.DiscoveryV1EndpointPort(name="http", port=8000, protocol="TCP")],
        endpoints=[client.V1Endpoint(addresses=[ip], conditions=client.V1EndpointConditions(ready=ready))
                   for ip in ips])


def _wait(pool: Pool, want: set[str]) -> None:
    deadline = time.monotonic() + 20
    while set(pool.workers) != want:
        assert time.monotonic() < deadline, f"pool {set(pool.workers)} never became {want}"
        time.sleep(0.1)


def test_router_pools_follow_endpoint_slices(kube_cluster):
    core, disc = client.CoreV1Api(kube_cluster.api_client), client.DiscoveryV1Api(kube_cluster.api_client)
    ns = f"disc-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    pools = {"chat-prefill": Pool(), "chat-decode": Pool()}
    stop = threading.Event()
    t = threading.Thread(target=watch_kubernetes, args=(pools, ns, kube_cluster.api_client, stop), daemon=True)
    t.start()
    try:
        disc.create_namespaced_endpoint_slice(ns, _slice("chat-decode-a", "chat-decode", ["10.9.0.1", "10.9.0.2"]))
        disc.create_namespaced_endpoint_slice(ns, _slice("chat-prefill-a", "chat-prefill", ["10.9.1.1"]))
        disc.create_namespaced_endpoint_slice(ns, _slice("other-a", "other", ["10.9.2.1"]))
        _wait(pools["chat-decode"], {"http://10.9.0.1:8000", "http://10.9.0.2:8000"})
        _wait(pools["chat-prefill"], {"http://10.9.1.1:8000"})
        # A pod that stops being ready leaves the pool; a deleted slice empties it.
        disc.replace_namespaced_endpoint_slice("chat-decode-a", ns, _slice(
            "chat-decode-a", "chat-decode", ["10.9.0.1"]))
        _wait(pools["chat-decode"], {"http://10.9.0.1:8000"})
        disc.replace_namespaced_endpoint_slice("chat-decode-a", ns, _slice(
            "chat-decode-a", "chat-decode", ["10.9.0.1"], ready=False))
        _wait(pools["chat-decode"], set())
        disc.delete_namespaced_endpoint_slice("chat-prefill-a", ns)
        _wait(pools["chat-prefill"], set())
    finally:
        stop.set()
        core.delete_namespace(ns)
