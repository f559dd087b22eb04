"""Suite-wide pytest configuration: registers the shared plugins."""

# The `kube_cluster` fixture (a real local control plane) for every test folder.
pytest_plugins = ["tests.kubecluster"]
