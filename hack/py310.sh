#!/usr/bin/env bash
# Python 3.10 is requires-python's floor and the runtime image's Python (Ubuntu 22.04). This
# checks the claim where a python3.10 exists (on PATH or under pyenv): every module byte-compiles
# under 3.10, and the unit tests that need no torch pass under it (a torch wheel for 3.10 is not
# installed here: the modules that load torch are checked by compiling only). The venv is cached.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
export PIP_CACHE_DIR=$cache/pip PIP_DISABLE_PIP_VERSION_CHECK=1
py310=
for c in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10.*/bin/python3.10 /usr/bin/python3.10 /usr/local/bin/python3.10; do
  # (a pyenv shim on PATH may name a python3.10 it will not run, hence the check)
  if [[ -x $c ]] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null; then py310=$c; fi
done
if [[ -z $py310 ]]; then
  echo "[py310] no python3.10 on PATH or under pyenv: the 3.10 check is skipped" >&2
  exit 0
fi
venv=$cache/venv310
stamp=$venv/.phasesplit-deps
want=$(cat "$root/pyproject.toml" "$root/setup.py" "$0" | sha256sum | cut -c1-16)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "[py310] installing the torch-free dependencies into $venv" >&2
  "$py310" -m venv "$venv"
  "$venv/bin/python" -m pip install -q fastapi uvicorn httpx "pydantic>=2" tokenizers jinja2 prometheus-client \
    gguf pyyaml kopf kubernetes pytest pytest-timeout matplotlib
  "$venv/bin/python" -m pip install -q --no-deps -e "$root"
  echo "$want" > "$stamp"
fi
# ensure_editable: hack/lib.sh (the cached venv may point at another checkout)
source "$root/hack/lib.sh"
ensure_editable "$venv/bin/python" "$root"
cd "$root"
"$venv/bin/python" -m compileall -q runtime operator tests >/dev/null
# The unit test files that import torch are left to the main suite.
torch_tests=$(grep -lE "^(import torch|from phasesplit\.runtime\.(engine\.(engine|model_runner|sampling|cuda_graphs)|kv|model\.(attention|llama|loader)|kernels|server import launch))" \
  tests/unit/test_*.py | sed 's/^/--ignore=/')
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/unit $torch_tests
