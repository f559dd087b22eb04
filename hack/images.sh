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
# Each image is cached as a docker-archive under ~/.cache/phasesplit/images/, keyed by a hash of
# its inputs (the Dockerfile, the sources it copies, its base, its build arguments); a warm run
# only hashes. pip downloads are cached in ~/.cache/phasesplit/pip (mounted into the builds).
# --import loads the archives into the running node's containerd (skipping what it already has).
# Prints each image's build time and size; the last stdout line per image is `NAME REF ARCHIVE`.
set -euo pipefail
shopt -s inherit_errexit  # a failing build inside $(...) must stop the script

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
out=$cache/images
state=${PHASESPLIT_CLUSTER_DIR:-${TMPDIR:-/tmp}/phasesplit-cluster-$(id -u)}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")
mirror=${PHASESPLIT_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The torch the image gets: the version the dev venv resolved (so local and pod numerics match),
# from PyPI with its CUDA libraries (it does not import without them), less triton.
torch_version=${PHASESPLIT_IMAGE_TORCH:-2.15.0}
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

mib() { echo "$(( $(stat -c %s "$1") / 1048576 )) MiB"; }

# archive NAME REF FILE: saves REF from buildah's store as a docker-archive, atomically.
archive() {
  rm -f "$3.tmp"
  bh push -q "$2" "docker-archive:$3.tmp:$2" >/dev/null
  mv -f "$3.tmp" "$3"
  # Older archives of the same image are dead weight.
  find "$out" -maxdepth 1 -name "$1-*.tar" ! -path "$3" -delete
}

report() { echo "$1 $2 $3"; }

# debootstrap mounts /proc and /sys in the rootfs while it works; a failed run can leave them.
rm_rootfs() {
  local m
  for m in $(awk -v p="$1/" 'index($5, p) == 1 {print $5}' /proc/self/mountinfo | sort -r); do umount -l "$m"; done
  rm -rf "$1"
}

build_base() {
  local h ref tar t0 tmp ctr
  h=$(echo "bookworm minbase python3 python3-venv ca-certificates libgomp1 $mirror v1" | hash_of)
  ref=localhost/phasesplit/base:$h tar=$out/base-$h.tar
  if [[ -f $tar ]] && bh inspect --type image "$ref" >/dev/null 2>&1; then
    say "base: cached ($ref, $(mib "$tar"))"; report base "$ref" "$tar"; return
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
  archive base "$ref" "$tar"
  say "base: built in $(( $(date +%s) - t0 )) s ($(mib "$tar"))"
  report base "$ref" "$tar"
}

build_pause() {
  local h ref tar t0 tmp ctr
  h=$( { cat "$root/hack/node/pause.c"; gcc --version | head -1; } | hash_of)
  ref=localhost/phasesplit/pause:3.10 tar=$out/pause-$h.tar
  if [[ -f $tar ]]; then say "pause: cached"; report pause "$ref" "$tar"; return; fi
  t0=$(date +%s)
  tmp=$(mktemp -d "$out/.pause.XXXXXX")
  gcc -static -Os -s -o "$tmp/pause" "$root/hack/node/pause.c"
  ctr=$(bh from --isolation chroot scratch)
  bh copy -q "$ctr" "$tmp/pause" /pause >/dev/null
  bh config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
  bh commit -q "$ctr" "$ref" >/dev/null
  bh rm "$ctr" >/dev/null
  rm -rf "$tmp"
  archive pause "$ref" "$tar"
  say "pause: built in $(( $(date +%s) - t0 )) s ($(mib "$tar"))"
  report pause "$ref" "$tar"
}

# build_dockerfile NAME BUILD-ARGS...: docker/NAME.Dockerfile on the local base.
build_dockerfile() {
  local name=$1; shift
  local base_ref h ref tar t0 args=("$@")
  base_ref=$(build_base | tail -n 1 | cut -d' ' -f2)
  h=$( { tree_hash "docker/$name.Dockerfile" .dockerignore pyproject.toml setup.py README.md runtime operator
         echo "$base_ref ${args[*]}"; } | hash_of)
  ref=ghcr.io/phasesplit/$name:$version tar=$out/$name-$h.tar
  if [[ -f $tar ]]; then say "$name: cached ($(mib "$tar"))"; report "$name" "$ref" "$tar"; return; fi
  t0=$(date +%s)
  say "$name: building docker/$name.Dockerfile on $base_ref ..."
  # --layers: unchanged steps (apt, torch) are reused from the store when only sources change.
  (cd "$root" && bh bud --isolation chroot --layers -q -f "docker/$name.Dockerfile" \
    --build-arg "BASE=$base_ref" --build-arg PIP_CACHE_DIR=/var/cache/phasesplit-pip "${args[@]}" "${ca_args[@]}" \
    -v "$cache/pip:/var/cache/phasesplit-pip" -t "$ref" . >&2)
  archive "$name" "$ref" "$tar"
  say "$name: built in $(( $(date +%s) - t0 )) s (archive $(mib "$tar"))"
  report "$name" "$ref" "$tar"
}

# import REF ARCHIVE: into the node's containerd unless it already holds this archive.
import() {
  local sock=$state/node/containerd/containerd.sock mark
  [[ -S $sock ]] || die "--import: no node running in $state (hack/node.sh up)"
  # The node keeps containerd's store in the cache (images survive `node.sh down`); so does the mark.
  mkdir -p "$cache/containerd/imported"
  mark=$cache/containerd/imported/$(basename "$2")
  if [[ -f $mark ]]; then say "$1: already in the node's containerd"; return; fi
  local t0=$(date +%s)
  ctr --address "$sock" -n k8s.io images import --all-platforms "$2" >/dev/null
  touch "$mark"
  say "$1: imported into the node's containerd in $(( $(date +%s) - t0 )) s"
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
  read -r _ ref tar <<<"$line"
  if (( do_import )) && [[ $n != base ]]; then import "$ref" "$tar"; fi
done
say "done in $(( $(date +%s) - t_all )) s"
