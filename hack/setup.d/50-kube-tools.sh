#!/usr/bin/env bash
# Part of hack/setup.sh: builds (once; cached afterwards) the Kubernetes tools the cluster tests
# need. PHASESPLIT_SKIP_CLUSTER=1 skips it, as it skips those tests.
set -euo pipefail
if [[ ${PHASESPLIT_SKIP_CLUSTER:-} == 1 ]]; then
  echo "[setup] PHASESPLIT_SKIP_CLUSTER=1: not building the Kubernetes tools" >&2
  exit 0
fi
bash "$(dirname "${BASH_SOURCE[0]}")/../kube-tools.sh" >/dev/null
