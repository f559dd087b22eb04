#!/usr/bin/env bash
# The test command: sets up (cached) and runs the whole suite. Extra args go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The real-node tests (tests/node: kubelet + containerd pods, hack/node.sh) and the builds they need
# (setup.d/55-56: packages, kubelet, CoreDNS, images). THE switch for whether this command runs them
# by default (on: the node has cluster DNS, so its tests exercise the real split); PHASESPLIT_NODE=0
# or =1 overrides it either way. See docs/cluster.md ("Figures") for what they cost warm and cold.
node_default=1
export PHASESPLIT_NODE=${PHASESPLIT_NODE:-$node_default}
bash "$root/hack/setup.sh"
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
cd "$root"
# The whole suite (no args, as CI runs it) also checks requires-python's floor, where a python3.10 exists,
# and lists its slowest tests: CI has 90 minutes, and the list says where they go.
if [[ $# -eq 0 ]]; then
  bash "$root/hack/py310.sh"
  set -- --durations=25
fi
exec "$cache/venv/bin/python" -m pytest -ra "$@"
