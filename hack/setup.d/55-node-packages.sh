#!/usr/bin/env bash
# Part of hack/setup.sh: the Debian packages the real node (hack/node.sh) and the image builds
# (hack/images.sh) need: containerd + runc + the CNI plugins, iptables/nftables/conntrack for
# kube-proxy, socat (the API server relay for pods), buildah + debootstrap to build images without
# a daemon or a registry, gcc for the static pause binary. Idempotent: nothing to do when every command is already there.
# Runs only with PHASESPLIT_NODE=1 (opt-in, as the node tests are);
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
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[setup] no apt-get: install ${missing[*]} yourself to run the real-node tests (tests/node)" >&2
  exit 0
fi
sudo=""
[[ $(id -u) == 0 ]] || sudo="sudo"
echo "[setup] installing ${missing[*]} (Debian packages, for the real node and image builds)" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# policy-rc.d: the packages must not start containerd as a system service (hack/node.sh runs its
# own, with its own config and state); where there is no init system this only silences errors.
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
  $sudo sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d'
  trap '$sudo rm -f /usr/sbin/policy-rc.d' EXIT
fi
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
