"""phasesplit runtime: model, engine, KV transfer, worker and router servers, CLI."""

import os

# How OpenMP threads wait between the ~1,000 small ops of a decode step decides single-stream
# speed on CPU. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs a futex wake per parallel op:
# measured here through the router, 21 tokens/s against 34 with a short spin. Spinning forever
# (ACTIVE) gains nothing more and, when another process is busy on the same cores, made a step
# 2-10x slower. So spin briefly (libgomp counts ~10k pause loops, tens of microseconds: enough to
# bridge the gap between two ops, not an idle wait) and then sleep. On cores shared with other
# busy work set OMP_WAIT_POLICY=PASSIVE; an explicit setting in the environment wins. Set before
# torch loads OpenMP. The thread count itself follows the CPU quota (model_runner.cpu_threads).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"
