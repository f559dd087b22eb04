#!/usr/bin/env bash
# Part of hack/setup.sh: installs the real Prometheus server (Debian's package) that the metrics
# integration test scrapes the runtime with. Idempotent: nothing to do when it is already there.
# PHASESPLIT_SKIP_PROMETHEUS=1 skips it (that test then fails with a message naming this script).
set -euo pipefail
if [[ ${PHASESPLIT_SKIP_PROMETHEUS:-} == 1 ]] || command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[setup] no apt-get: install Prometheus yourself (any 2.x) to run tests/integration/test_metrics_prometheus.py" >&2
  exit 0
fi
sudo=""
[[ $(id -u) == 0 ]] || sudo="sudo"
echo "[setup] installing prometheus (Debian package)" >&2
# Only the server binary is used; do not let the package start a system service.
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
