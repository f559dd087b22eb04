#!/usr/bin/env bash
# The test command: sets up (cached) and runs the whole suite. Extra args go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/hack/setup.sh"
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
cd "$root"
exec "$cache/venv/bin/python" -m pytest -ra "$@"
