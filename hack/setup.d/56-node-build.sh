#!/usr/bin/env bash
# Part of hack/setup.sh: builds (once; cached afterwards, keyed by their inputs) what the real-node
# tests need: kubelet, kube-proxy and CoreDNS (hack/kube-tools.sh node) and the images (hack/images.sh:
# Debian base, pause, runtime, operator). Runs only with PHASESPLIT_NODE=1 (./hack/test.sh sets it by default, as it runs the node tests);
# PHASESPLIT_SKIP_CLUSTER=1
# skips it, as it skips those tests.
set -euo pipefail
if [[ ${PHASESPLIT_SKIP_CLUSTER:-} == 1 || ${PHASESPLIT_NODE:-} != 1 ]]; then
  exit 0
fi
here=$(dirname "${BASH_SOURCE[0]}")
if [[ $(id -u) != 0 ]] || ! command -v buildah >/dev/null 2>&1; then
  echo "[setup] not root or no buildah: not building the real node's tools and images (tests/node skip)" >&2
  exit 0
fi
bash "$here/../kube-tools.sh" node >/dev/null
bash "$here/../images.sh" >/dev/null
