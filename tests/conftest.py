"""Suite-wide pytest configuration: registers the shared plugins."""

import os
import signal

# Tests run several runtime processes at once on few cores: OpenMP threads that spin-wait
# (the runtime's default for a process that owns its cores) would starve each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The `kube_cluster` fixture (a real local control plane) for every test folder.
pytest_plugins = ["tests.kubecluster"]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: object) -> None:
    # A killed run (`kill` of `.ci/run` or `hack/test.sh`, which exec pytest) ends as Ctrl-C does:
    # the session's fixtures then stop the local control plane, node and workers they started.
    # Under SIGTERM's default they stayed up (etcd, kube-apiserver, kwok, the operator, workers)
    # with their lock files, in the way of the next run.
    signal.signal(signal.SIGTERM, _interrupt)
