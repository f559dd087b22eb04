"""phasesplit runtime: model, engine, KV transfer, worker and router servers, CLI."""

import os

# How OpenMP threads wait between the ~1,000 small ops of a decode step decides single-stream
# speed on CPU, and there is no setting that is best everywhere. Measured here (2 threads,
# single-stream decode): sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs a futex wake per
# parallel op, 21 tokens/s through the router on an idle machine against 34 with a short spin
# (GOMP_SPINCOUNT=10000); but as soon as another process is busy on the same cores, spinning
# threads wait on descheduled siblings: 6-10 tokens/s against PASSIVE's 23. A server must not
# fall off that cliff because a neighbour woke up, so PASSIVE is the default; on cores the
# process owns (pinned, or a Kubernetes Guaranteed pod under the static CPU manager) set
# GOMP_SPINCOUNT=10000 without OMP_WAIT_POLICY. An explicit setting in the environment wins.
# Set before torch loads OpenMP. The thread count follows the CPU quota (model_runner.cpu_threads).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
