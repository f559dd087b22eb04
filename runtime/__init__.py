"""phasesplit runtime: model, engine, KV transfer, worker and router servers, CLI."""

import os

# OpenMP threads that spin while waiting turn every one of the ~1,000 small ops of a decode step
# into a wait on a descheduled sibling as soon as anything else runs on the node (a router, a
# sidecar, a noisy neighbour, a CFS quota): measured here, 2 threads with spinning fell from 22
# to 2.3 tokens/s when one other process was busy. Sleeping waiters cost little and avoid that.
# Set before torch loads OpenMP; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
