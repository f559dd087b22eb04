#!/usr/bin/env bash
# Part of hack/setup.sh: installs the real Prometheus server (Debian's package) that the metrics
# integration test scrapes the runtime with. Idempotent: nothing to do when it is already there.
# PHASESPLIT_SKIP_PROMETHEUS=1 skips it (that test then fails with a message naming this script).
set -euo pipefail
if [[ ${PHASESPLIT_SKIP_PROMETHEUS:-} == 1 ]] || command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
# apt_install: hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
apt_install "(any Prometheus 2.x) to run tests/integration/test_metrics_prometheus.py" prometheus
