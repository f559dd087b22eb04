#!/usr/bin/env bash
# The test command: sets up (cached) and runs the whole suite. Extra args go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/hack/setup.sh"
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
cd "$root"
# The whole suite (no args, as CI runs it) also checks requires-python's floor, where a python3.10 exists.
if [[ $# -eq 0 ]]; then bash "$root/hack/py310.sh"; fi
exec "$cache/venv/bin/python" -m pytest -ra "$@"
