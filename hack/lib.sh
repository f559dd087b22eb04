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

# apt_install PURPOSE PKG...: installs Debian packages for hack/setup.d's scripts, without letting
# them start system services (the tests run their own containerd and Prometheus, with their own
# config). Without apt-get it says what to install by hand, for PURPOSE, and returns 0: the tests
# that need the packages then skip or fail naming them.
apt_install() {
  local purpose=$1; shift
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "[setup] no apt-get: install $* yourself $purpose" >&2
    return 0
  fi
  local sudo=""
  [[ $(id -u) == 0 ]] || sudo="sudo"
  echo "[setup] installing $* (Debian packages) $purpose" >&2
  local policy=""
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    # Exit 101 = "action forbidden": postinst scripts then start no service.
    $sudo sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d'
    policy=/usr/sbin/policy-rc.d
  fi
  local rc=0
  { DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } || rc=$?
  [[ -z $policy ]] || $sudo rm -f "$policy"
  return $rc
}

# pid_runs PIDFILE PATTERN: true when the pid in PIDFILE is alive and its command line contains
# PATTERN (a pid file can outlive its process, and pids are reused).
pid_runs() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q -- "$2"
}
