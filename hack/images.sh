#!/usr/bin/env bash
# Builds the images the real node (hack/node.sh) runs, with buildah (no daemon, no registry):
#
#   base      Debian bookworm (debootstrap minbase) + python3: the BASE of both Dockerfiles here,
#             where python:* and nvidia/cuda:* cannot be pulled
#   pause     the pod sandbox image (hack/node/pause.c, static)
#   runtime   docker/runtime.Dockerfile, with PyPI's torch (less triton; runs on CPU and GPU)
#   operator  docker/operator.Dockerfile
#
#   hack/images.sh [--import] [NAME...]   (default: all four)
#
# Images live in buildah's own store under ~/.cache/phasesplit/buildah, each stamped
# (images/NAME.inputs) with a hash of its inputs (the Dockerfile, the sources it copies, its base,
# its build arguments); a warm run only hashes. buildah's layer cache (--layers) rebuilds only the
# steps after the first changed input: the runtime image keeps the OS packages, torch and the
# other dependencies in layers of their own and phasesplit's code in the last, so a code change
# rebuilds a few MB. pip downloads are cached in ~/.cache/phasesplit/pip (mounted into the builds).
# --import streams an image into the running node's containerd (a docker-archive on a pipe: no
# archive on disk, and no compression, which would cost minutes for torch's layer on every push):
# nothing when containerd already has that build (an image label records the inputs hash), and
# only the layers it lacks are sent, stored and unpacked (hack/node/oci_delta.py; the others are
# read past on the pipe).
# Prints each image's build time; the last stdout line per image is `NAME REF INPUTS-HASH`.
set -euo pipefail
shopt -s inherit_errexit  # a failing build inside $(...) must stop the script

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
out=$cache/images
state=${PHASESPLIT_CLUSTER_DIR:-${TMPDIR:-/tmp}/phasesplit-cluster-$(id -u)}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")
mirror=${PHASESPLIT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The torch the image gets: constraints.txt's, the dev venv's (so local and pod numerics match),
# from PyPI with its CUDA libraries (it does not import without them), less triton.
torch_version=${PHASESPLIT_IMAGE_TORCH:-$(sed -n 's/^torch==//p' "$root/constraints.txt")}
[[ -n $torch_version ]] || { echo "[images] error: constraints.txt pins no torch" >&2; exit 1; }
torch_args="torch==$torch_version"

say() { echo "[images] $*" >&2; }
die() { say "error: $*"; exit 1; }

for c in buildah debootstrap gcc; do
  command -v "$c" >/dev/null || die "$c is not installed (hack/setup.d/55-node-packages.sh installs it)"
done
mkdir -p "$out" "$cache/pip" "$cache/buildah"
exec 8>"$out/.lock"
flock 8   # one builder at a time: builds share the buildah store

# buildah's own store under our cache (layers survive between runs); chroot isolation: the default
# isolation would create a CNI bridge (cni-podman0) for every RUN.
bh() { buildah --root "$cache/buildah/storage" --runroot "$cache/buildah/run" --storage-driver overlay "$@"; }
# Working containers of an interrupted build (still mounted), then, when we are done, the private
# mount containers/storage keeps on its overlay directory: nothing stays mounted between builds.
bh rm --all >/dev/null 2>&1 || true
trap 'bh rm --all >/dev/null 2>&1 || true; umount "$cache/buildah/storage/overlay" 2>/dev/null || true' EXIT

# Where TLS is intercepted (a proxy with its own CA, as in this project's sandboxes), pip inside the
# build needs that CA: the host's bundle is mounted read-only for the build only (not in the image).
ca_args=()
host_ca=${PIP_CERT:-${SSL_CERT_FILE:-}}
if [[ -n $host_ca && -f $host_ca ]]; then
  ca_args=(-v "$host_ca:/etc/phasesplit-build-ca.crt:ro" --build-arg PIP_CERT=/etc/phasesplit-build-ca.crt)
fi

hash_of() { sha256sum | cut -c1-16; }
# Content hash of tracked and untracked (not ignored) files under the given paths.
tree_hash() {
  (cd "$root" && git ls-files -co --exclude-standard -- "$@" | LC_ALL=C sort | grep -v '__pycache__' \
    | while read -r f; do if [[ -f $f ]]; then echo "$f"; cat "$f"; fi; done) | hash_of
}

# stamped NAME REF HASH: buildah's store holds REF built from inputs HASH.
stamped() { [[ $(cat "$out/$1.inputs" 2>/dev/null) == "$3" ]] && bh inspect --type image "$2" >/dev/null 2>&1; }
stamp() { echo "$2" > "$out/$1.inputs"; }
size() { bh images --format '{{.Size}}' "$1" 2>/dev/null | head -n 1; }

report() { echo "$1 $2 $3"; }

# Archives of an earlier hack/images.sh (docker-archives, OCI layouts): gigabytes of dead weight.
find "$out" -maxdepth 1 -name '*-*.tar' -delete
rm -rf "$out"/*.oci

# debootstrap mounts /proc and /sys in the rootfs while it works; a failed run can leave them.
rm_rootfs() {
  local m
  for m in $(awk -v p="$1/" 'index($5, p) == 1 {print $5}' /proc/self/mountinfo | sort -r); do umount -l "$m"; done
  rm -rf "$1"
}

build_base() {
  local h ref t0 tmp ctr
  h=$(echo "bookworm minbase python3 python3-venv ca-certificates libgomp1 $mirror v1" | hash_of)
  # Only ever used FROM buildah's own store (its tag carries the hash): no layout of its own.
  ref=localhost/phasesplit/base:$h
  if bh inspect --type image "$ref" >/dev/null 2>&1; then
    say "base: cached ($ref)"; report base "$ref" -; return
  fi
  t0=$(date +%s)
  tmp=$(mktemp -d "$out/.rootfs.XXXXXX")
  say "base: debootstrap bookworm (minbase + python3) from $mirror ..."
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libgomp1 \
    bookworm "$tmp/rootfs" "$mirror" > "$tmp/debootstrap.log" 2>&1 \
    || { tail -n 20 "$tmp/debootstrap.log" >&2; rm_rootfs "$tmp"; die "debootstrap failed"; }
  # Trim what an image never needs: package lists, docs, man pages, locales, apt's caches.
  rm -rf "$tmp"/rootfs/var/lib/apt/lists/* "$tmp"/rootfs/var/cache/apt/* "$tmp"/rootfs/usr/share/{doc,man,info}/* \
    "$tmp"/rootfs/usr/share/locale/* "$tmp"/rootfs/var/log/*
  tar -C "$tmp/rootfs" --numeric-owner -cf "$tmp/rootfs.tar" .
  ctr=$(bh from --isolation chroot scratch)
  bh add -q "$ctr" "$tmp/rootfs.tar" / >/dev/null
  bh config --cmd '["bash"]' --env LANG=C.UTF-8 "$ctr"
  bh commit -q "$ctr" "$ref" >/dev/null
  bh rm "$ctr" >/dev/null
  rm_rootfs "$tmp"
  say "base: built in $(( $(date +%s) - t0 )) s"
  report base "$ref" -
}

build_pause() {
  local h ref t0 tmp ctr
  h=$( { cat "$root/hack/node/pause.c"; gcc --version | head -1; } | hash_of)
  ref=localhost/phasesplit/pause:3.10
  if stamped pause "$ref" "$h"; then say "pause: cached"; report pause "$ref" "$h"; return; fi
  t0=$(date +%s)
  tmp=$(mktemp -d "$out/.pause.XXXXXX")
  gcc -static -Os -s -o "$tmp/pause" "$root/hack/node/pause.c"
  ctr=$(bh from --isolation chroot scratch)
  bh copy -q "$ctr" "$tmp/pause" /pause >/dev/null
  bh config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
  bh commit -q "$ctr" "$ref" >/dev/null
  bh rm "$ctr" >/dev/null
  rm -rf "$tmp"
  stamp pause "$h"
  say "pause: built in $(( $(date +%s) - t0 )) s"
  report pause "$ref" "$h"
}

# build_dockerfile NAME BUILD-ARGS...: docker/NAME.Dockerfile on the local base.
build_dockerfile() {
  local name=$1; shift
  local base_ref h ref t0 args=("$@")
  base_ref=$(build_base | tail -n 1 | cut -d' ' -f2)
  h=$( { tree_hash "docker/$name.Dockerfile" .dockerignore pyproject.toml constraints.txt setup.py README.md runtime operator
         echo "$base_ref ${args[*]}"; } | hash_of)
  ref=ghcr.io/phasesplit/$name:$version
  if stamped "$name" "$ref" "$h"; then say "$name: cached ($(size "$ref"))"; report "$name" "$ref" "$h"; return; fi
  t0=$(date +%s)
  say "$name: building docker/$name.Dockerfile on $base_ref ..."
  # --layers: unchanged steps (apt, torch) are reused from the store when only sources change.
  (cd "$root" && bh bud --isolation chroot --layers -q -f "docker/$name.Dockerfile" \
    --build-arg "BASE=$base_ref" --build-arg PIP_CACHE_DIR=/var/cache/phasesplit-pip "${args[@]}" "${ca_args[@]}" \
    -v "$cache/pip:/var/cache/phasesplit-pip" -t "$ref" . >&2)
  stamp "$name" "$h"
  say "$name: built in $(( $(date +%s) - t0 )) s ($(size "$ref"))"
  report "$name" "$ref" "$h"
}

sock=$state/node/containerd/containerd.sock
ctr_() { ctr --address "$sock" -n k8s.io "$@"; }

# import REF HASH: into the node's containerd, unless it holds this build already.
import() {
  local t0 label=phasesplit.io/inputs
  [[ -S $sock ]] || die "--import: no node running in $state (hack/node.sh up)"
  # The node keeps containerd's store in the cache: images survive `node.sh down`.
  if ctr_ images ls "name==$1" | grep -q "$label=$2"; then
    say "${1##*/}: already in the node's containerd"; return
  fi
  t0=$(date +%s)
  # Only the layers containerd lacks (hack/node/oci_delta.py rewrites the stream into an OCI
  # archive that names the others as containerd holds them): a code change ships the code layer,
  # not torch's 4.3 GB again. Unpacking skips layers whose snapshots exist.
  if bh push -q "$1" "docker-archive:/dev/stdout:$1" \
       | python3 "$root/hack/node/oci_delta.py" --address "$sock" --name "$1" \
       | ctr_ images import --all-platforms - >/dev/null \
     && complete "$1"; then
    say "${1##*/}: imported into the node's containerd in $(( $(date +%s) - t0 )) s (only the layers it lacked)"
  else
    say "${1##*/}: the layer-delta import failed or left the image incomplete; importing every layer"
    t0=$(date +%s)
    bh push -q "$1" "docker-archive:/dev/stdout:$1" | ctr_ images import --all-platforms - >/dev/null
    complete "$1" || die "${1##*/}: containerd reports the image incomplete after a full import"
    say "${1##*/}: imported into the node's containerd in $(( $(date +%s) - t0 )) s (every layer)"
  fi
  ctr_ images label "$1" "$label=$2" >/dev/null
}

# complete REF: containerd holds every blob of REF and has unpacked it (`ctr images check`:
# REF TYPE DIGEST STATUS... UNPACKED, STATUS as `complete (N/N)`).
complete() {
  ctr_ images check "name==$1" | awk 'NR > 1 && / complete \(/ && $NF == "true" {ok = 1} END {exit !ok}'
}

do_import=0
names=()
for a in "$@"; do
  case $a in
    --import) do_import=1 ;;
    base|pause|runtime|operator) names+=("$a") ;;
    *) echo "usage: $0 [--import] [base|pause|runtime|operator]..." >&2; exit 2 ;;
  esac
done
(( ${#names[@]} )) || names=(base pause runtime operator)

t_all=$(date +%s)
for n in "${names[@]}"; do
  case $n in
    base) line=$(build_base | tail -n 1) ;;
    pause) line=$(build_pause | tail -n 1) ;;
    runtime) line=$(build_dockerfile runtime --build-arg "TORCH_PIP_ARGS=$torch_args" --build-arg TORCH_DROP=triton \
                      | tail -n 1) ;;
    operator) line=$(build_dockerfile operator | tail -n 1) ;;
  esac
  echo "$line"
  read -r _ ref h <<<"$line"
  if (( do_import )) && [[ $n != base ]]; then import "$ref" "$h"; fi
done
say "done in $(( $(date +%s) - t_all )) s"
