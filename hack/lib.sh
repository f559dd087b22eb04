# Shell helpers shared by the hack/ scripts (sourced, not run).

# free_ports N: N distinct TCP ports that are free on 127.0.0.1 right now (held open together
# while choosing, so they differ). Fixed ports would clash with another cluster or service.
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

# ensure_editable PY ROOT: make PY's editable install of phasesplit point at ROOT. A cached venv
# keeps pointing at whichever checkout last installed into it, so a second clone (CI's, a fresh
# one) would otherwise test the other checkout's code.
ensure_editable() {
  local py=$1 root=$2
  "$py" -c "import phasesplit.runtime, os, sys; sys.exit(os.path.realpath(phasesplit.runtime.__path__[0]) != os.path.realpath(sys.argv[1]))" \
    "$root/runtime" 2>/dev/null && return 0
  echo "[setup] pointing $py's editable install at $root" >&2
  "$py" -m pip install -q --no-deps -e "$root"
}
