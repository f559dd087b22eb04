#!/usr/bin/env bash
# The main job: sets up (cached) and serves the bundled model locally, phase-split. Args go to `phasesplit up`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PHASESPLIT_SKIP_CLUSTER=1 PHASESPLIT_SKIP_PROMETHEUS=1 bash "$root/hack/setup.sh"
exec "${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}/venv/bin/phasesplit" up "$@"
