# Shell helpers shared by hack/cluster.sh and hack/node.sh (sourced, not run).

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
