"""What a service costs the operator after its first pass, in-process (issue 14 acceptance 5).

    ~/.cache/phasesplit/venv/bin/python tests/bench/operator_passes.py [--services 200]

Against the unit tests' in-memory API (tests/unit/test_operator_reconcile.py's GenerationKube, so
no API server or network time is counted): the first pass of every service, the watch echoes of
its 14 children, then 3 rounds of status updates of its 3 Deployments and 3
PodDisruptionBudgets, each with the passes it queues (what the control plane's progress sends
while pods start). Prints CPU milliseconds per service for each phase. To compare with another
version of the operator, put that version's package first on PYTHONPATH (a directory holding
phasesplit/operator and phasesplit/runtime).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_operator_reconcile import GenerationKube, controller, parent  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=200)
    n = ap.parse_args().services
    k = GenerationKube()
    c = controller(k)
    for i in range(n):
        p = parent()
        p["metadata"].update(name=f"s{i}", uid=f"uid-{i}")
        c.observe_parent(None, p)

    def drain() -> None:
        while (key := c.queue.get(timeout=0)) is not None:
            c._reconcile(key)
            c.queue.done(key)

    t = time.process_time()
    drain()
    first = time.process_time() - t
    t = time.process_time()
    for key in list(k.objects):
        c.observe_child("MODIFIED", k.view(key))
    drain()
    echoes = time.process_time() - t
    t = time.process_time()
    for step in range(3):
        ready = {"replicas": step, "readyReplicas": step, "updatedReplicas": step, "observedGeneration": 1}
        for i in range(n):
            for component in ("prefill", "decode", "router"):
                for kind, status in (("Deployment", ready), ("PodDisruptionBudget", {"currentHealthy": step})):
                    key = (kind, f"s{i}-{component}")
                    if key in k.objects:
                        k.edit(key, lambda o, status=status: o.update(status=dict(status)))
                        c.observe_child("MODIFIED", k.view(key))
        drain()
    updates = time.process_time() - t
    print(f"{n} services, CPU ms per service: first pass {1000 * first / n:.1f}, echoes {1000 * echoes / n:.1f}, "
          f"status updates {1000 * updates / n:.1f} (the in-memory API's own copying included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
