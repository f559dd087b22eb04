"""Suite-wide pytest configuration: registers the shared plugins."""

import os

# Tests run several runtime processes at once on few cores: OpenMP threads that spin-wait
# (the runtime's default for a process that owns its cores) would starve each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The `kube_cluster` fixture (a real local control plane) for every test folder.
pytest_plugins = ["tests.kubecluster"]
