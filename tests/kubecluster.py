"""pytest plugin: a real local Kubernetes control plane shared by every cluster test of a session.

Registered for the whole suite by ``tests/conftest.py`` (``pytest_plugins = ["tests.kubecluster"]``).
Tests ask for the session-scoped ``kube_cluster`` fixture and carry the ``cluster`` marker::

    @pytest.mark.cluster
    def test_something(kube_cluster):
        kube_cluster.kubectl("apply", "-f", "-", input=manifest)
        apps = kubernetes.client.AppsV1Api(kube_cluster.api_client)

The fixture runs ``hack/cluster.sh up``: it reuses a cluster that is already up (for instance one a
developer started by hand, which it leaves running) and otherwise starts one, which it stops again
at the end of the session (the last of several concurrent sessions using it does). Cluster tests
skip only when ``PHASESPLIT_SKIP_CLUSTER=1``; everywhere else, CI included, they run.

The interface (``kubeconfig``, ``bin_dir``, ``api_client``, ``env``, ``kubectl()``) is what the
operator's tests build on; extend it, do not change it.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_SH = ROOT / "hack" / "cluster.sh"
SKIP_ENV = "PHASESPLIT_SKIP_CLUSTER"
STARTED_MARKER = "started-by-pytest"
# Start-up takes seconds once the tools are cached; this also covers building them (normally done
# beforehand by hack/setup.sh) on a slow machine.
UP_TIMEOUT_S = 3600


def cluster_skipped() -> bool:
    return os.environ.get(SKIP_ENV) == "1"


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl call; unlike its base class, its message shows what kubectl printed."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


@dataclass
class KubeCluster:
    """A running cluster: admin credentials and the cached tools that match its version."""

    kubeconfig: str
    bin_dir: str
    api_client: k8s_client.ApiClient
    env: dict[str, str] = field(default_factory=dict)
    """os.environ plus KUBECONFIG and PATH (cached kubectl and helm first), for subprocesses."""

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Runs the cached kubectl against this cluster; text in and out, output captured."""
        cmd = [os.path.join(self.bin_dir, "kubectl"), "--kubeconfig", self.kubeconfig, *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self.env, timeout=300)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc


def _parse_exports(stdout: str) -> tuple[str, str]:
    """KUBECONFIG and the bin dir from cluster.sh's `export ...` lines."""
    kubeconfig = bin_dir = ""
    for line in stdout.splitlines():
        if line.startswith("export KUBECONFIG="):
            kubeconfig = line.removeprefix("export KUBECONFIG=")
        elif line.startswith("export PATH="):
            bin_dir = line.removeprefix("export PATH=").split(":", 1)[0]
    if not kubeconfig or not bin_dir:
        raise RuntimeError(f"hack/cluster.sh printed no export lines:\n{stdout}")
    return kubeconfig, bin_dir


def _cluster_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # stderr (progress lines) goes straight to the terminal: a cold build is long and should show.
    return subprocess.run(
        ["bash", str(CLUSTER_SH), *args],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    """The local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok with two
    untainted fake nodes of 8 nvidia.com/gpu each), up and ready."""
    if cluster_skipped():
        pytest.skip(f"{SKIP_ENV}=1")

    # Every session using the cluster holds a shared lock on users.lock in its state directory for
    # as long as it runs. A cluster that a test session started (marked by STARTED_MARKER) is stopped
    # by whichever session finishes last; one started by hand is left alone.
    users = None
    for _ in range(3):
        was_up = _cluster_sh("status", timeout=60).returncode == 0
        up = _cluster_sh("up", timeout=UP_TIMEOUT_S)
        if up.returncode != 0:
            pytest.fail(f"hack/cluster.sh up failed (exit {up.returncode}); see its output above")
        kubeconfig, bin_dir = _parse_exports(up.stdout)
        state = Path(kubeconfig).parent
        users = open(state / "users.lock", "a")  # held all session
        fcntl.flock(users, fcntl.LOCK_SH)
        # Another session may have stopped the cluster between our `up` and our lock.
        if _cluster_sh("status", timeout=60).returncode == 0:
            if not was_up:
                (state / STARTED_MARKER).touch()
            break
        users.close()
        users = None
    if users is None:
        pytest.fail("the cluster kept disappearing while starting (another test session stopping it?)")

    env = dict(os.environ, KUBECONFIG=kubeconfig, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    client = k8s_config.new_client_from_config(config_file=kubeconfig)
    try:
        yield KubeCluster(kubeconfig=kubeconfig, bin_dir=bin_dir, api_client=client, env=env)
    finally:
        client.close()
        fcntl.flock(users, fcntl.LOCK_UN)
        if (state / STARTED_MARKER).exists():
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(
                    "\n[kube_cluster] another test session still uses the cluster; it stops it when done",
                    file=sys.stderr,
                )
            else:
                # We hold the exclusive lock (no other session uses it), which `down` would read as
                # the cluster being in use.
                _cluster_sh("down", "--force", timeout=120)
        users.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Honour the one opt-out also for `cluster` tests that do not use the fixture directly."""
    if not cluster_skipped():
        return
    skip = pytest.mark.skip(reason=f"{SKIP_ENV}=1")
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(skip)
