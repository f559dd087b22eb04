#!/usr/bin/env bash
# Part of hack/setup.sh: the Debian packages the real node (hack/node.sh) and the image builds
# (hack/images.sh) need: containerd + runc + the CNI plugins, iptables/nftables/conntrack for
# kube-proxy, socat (the API server relay for pods), buildah + debootstrap to build images without
# a daemon or a registry, gcc for the static pause binary. Idempotent: nothing to do when every command is already there.
# Runs only with PHASESPLIT_NODE=1 (./hack/test.sh sets it by default, as it runs the node tests);
# PHASESPLIT_SKIP_CLUSTER=1 skips it (the node tests then skip, naming
# this script).
set -euo pipefail
if [[ ${PHASESPLIT_SKIP_CLUSTER:-} == 1 || ${PHASESPLIT_NODE:-} != 1 ]]; then
  exit 0
fi
# command -> package
declare -A want=(
  [containerd]=containerd [runc]=runc [/usr/lib/cni/bridge]=containernetworking-plugins
  [iptables]=iptables [nft]=nftables [conntrack]=conntrack [buildah]=buildah
  [debootstrap]=debootstrap [gcc]=gcc [socat]=socat [ip]=iproute2 [mount.fuse3]=fuse3
)
missing=()
for c in "${!want[@]}"; do
  if [[ $c == /* ]]; then [[ -e $c ]] || missing+=("${want[$c]}"); else command -v "$c" >/dev/null 2>&1 || missing+=("${want[$c]}"); fi
done
(( ${#missing[@]} )) || exit 0
# apt_install: hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
apt_install "for the real node and image builds (tests/node)" "${missing[@]}"
