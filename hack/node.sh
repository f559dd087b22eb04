#!/usr/bin/env bash
# A REAL node joined to the local control plane of hack/cluster.sh, beside its kwok GPU nodes:
# containerd + runc + the CNI bridge plugin (Debian's packages), kubelet, kube-proxy and CoreDNS (built
# from source by hack/kube-tools.sh node), the pause image built here (hack/images.sh). Pods on it run
# for real: probes, ports, env, read-only root, emptyDir, Services via kube-proxy (nftables mode), and
# Service names via the cluster DNS (CoreDNS as a host process on the node's bridge address).
#
#   hack/node.sh up       start it (the cluster must be up); prints the same exports as cluster.sh
#   hack/node.sh down     stop it and remove everything it made (hack/cluster.sh down calls this)
#   hack/node.sh status   exit 0 when it is up and Ready
#
# The node is labelled node.phasesplit.io/real=true and tainted node.phasesplit.io/real=true:NoSchedule,
# so only pods that select and tolerate it land there (manifests/samples/smollm2-cpu.yaml does).
# Its allocatable is this 2-core machine less a reserve (PHASESPLIT_NODE_CPU / _MEMORY set it).
#
# Needs root (it runs containers), cgroup v1 or v2, nf_tables, a bridge. State lives in
# $PHASESPLIT_CLUSTER_DIR/node; containerd's image store in ~/.cache/phasesplit/containerd, so
# imported images survive `down` (nothing is mounted or running there after `down`).
#
# What this host taught us (see docs/cluster.md): the root process here cannot lower
# oom_score_adj (no CAP_SYS_RESOURCE), so containerd restricts it and the kubelet leaves its own
# at 0; kubelet >= 1.35 refuses cgroup v1 unless failCgroupV1 is false; containerd 1.6 cannot report
# its cgroup driver, so the kubelet is told (cgroupfs).
set -euo pipefail
# free_ports, pid_runs: hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
cstate=${PHASESPLIT_CLUSTER_DIR:-${TMPDIR:-/tmp}/phasesplit-cluster-$(id -u)}
nstate=$cstate/node
croot=$cache/containerd
node_name=phasesplit-node
bridge=psnode0
pod_subnet=10.89.0.0/24
node_ip=10.89.0.1
cgroup_root=phasesplit-node
label_key=node.phasesplit.io/real
# The node's model cache: the hostPath of manifests/samples/smollm2-cpu.yaml's spec.model.cache,
# writable by the runtime's uid 1000. Like containerd's image store it outlives `down`: the first
# pod converts the model into it, every later pod (restarts, rollouts, scale-ups, the next run) reads it.
model_cache=/var/cache/phasesplit
runtime_uid=1000
# CPU and memory the node offers pods: 2 cores less what the kubelet, containerd and the host need.
alloc_cpu_m=${PHASESPLIT_NODE_CPU:-1800m}
alloc_mem=${PHASESPLIT_NODE_MEMORY:-10Gi}
# The cluster DNS: CoreDNS on the node's bridge address, the kubelet's clusterDNS for every pod.
cluster_domain=cluster.local
dns_user=system:phasesplit-node:coredns
sysctls=(net.bridge.bridge-nf-call-iptables net.ipv4.ip_forward vm.overcommit_memory kernel.panic kernel.panic_on_oops)

say() { echo "[node] $*" >&2; }
die() { say "error: $*"; exit 1; }

kubectl_() { "$(cat "$cstate/bin-dir")/kubectl" --kubeconfig "$cstate/kubeconfig" "$@"; }
ctr_() { ctr --address "$nstate/containerd/containerd.sock" -n k8s.io "$@"; }

# is_ours NAME PATTERN: pid_runs (hack/lib.sh) on NAME's pid file.
is_ours() { pid_runs "$nstate/pids/$1" "$2"; }

start() {
  local name=$1; shift
  setsid "$@" > "$nstate/logs/$name.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$nstate/pids/$name"
  say "started $name (pid $!)"
}

wait_for() {
  local what=$1 limit=$2 log=$3 t0; shift 3
  t0=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    if (( $(date +%s) - t0 >= limit )); then
      say "timed out after ${limit}s waiting for $what; last lines of $log:"
      tail -n 25 "$nstate/logs/$log.log" >&2 || true
      return 1
    fi
    sleep 0.3
  done
}

# cgroup directories of every hierarchy (v1: one per controller; v2: the unified one).
cgroup_dirs() {
  local d
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then echo /sys/fs/cgroup/$cgroup_root; return; fi
  for d in /sys/fs/cgroup/*/; do
    if [[ -d $d ]]; then echo "${d%/}/$cgroup_root"; fi
  done
}

apiserver_url() { sed -n 's/^ *server: //p' "$cstate/kubeconfig" | head -n 1; }

# leaf NAME SUBJECT: a client certificate signed by the cluster's CA.
leaf() {
  local pki=$cstate/pki d=$nstate/pki
  openssl ecparam -name prime256v1 -genkey -noout -out "$d/$1.key" 2>/dev/null
  openssl req -new -key "$d/$1.key" -subj "$2" 2>/dev/null \
    | openssl x509 -req -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial -days 365 \
      -extfile <(printf '%s\n' "keyUsage=critical,digitalSignature,keyEncipherment" "extendedKeyUsage=clientAuth") \
      -out "$d/$1.crt" 2>/dev/null
  cat > "$nstate/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: phasesplit
  cluster: {server: "$(apiserver_url)", certificate-authority: "$pki/ca.crt"}
users:
- name: $1
  user: {client-certificate: "$d/$1.crt", client-key: "$d/$1.key"}
contexts:
- name: phasesplit
  context: {cluster: phasesplit, user: $1}
current-context: phasesplit
EOF
}


# What `down` restores: sysctls, the nftables ruleset (iptables-nft's tables included: kube-proxy,
# the kubelet and CNI all add rules), and which shared host paths existed before.
snapshot_host() {
  local s
  mkdir -p "$nstate/host"
  for s in "${sysctls[@]}"; do sysctl -n "$s" > "$nstate/host/$s" 2>/dev/null || true; done
  nft list ruleset > "$nstate/host/nft.rules"
  for p in /run/containerd /var/lib/cni /var/log/containers /run/netns; do
    [[ -e $p ]] && echo "$p" >> "$nstate/host/existed"
  done
  ls /run/netns 2>/dev/null > "$nstate/host/netns" || true
  touch "$nstate/host/existed"
}

node_ready() {
  [[ $(kubectl_ get node "$node_name" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}') == True ]]
}

ready() {
  [[ -f $nstate/ready ]] || return 1
  is_ours containerd "containerd --config" && is_ours kubelet "kubelet " && is_ours kube-proxy "kube-proxy " \
    && is_ours coredns "coredns -conf" || return 1
  node_ready
}

write_configs() {
  local ca=$cstate/pki/ca.crt
  mkdir -p "$nstate/cni" "$nstate/containerd" "$croot"
  cat > "$nstate/containerd/config.toml" <<EOF
version = 2
root = "$croot/root"
state = "$nstate/containerd/state"
# Nothing here may lower an oom_score_adj (see the top of hack/node.sh).
oom_score = 0
[grpc]
  address = "$nstate/containerd/containerd.sock"
[ttrpc]
  address = "$nstate/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$nstate/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/phasesplit/pause:3.10"
  restrict_oom_score_adj = true
  # Pods' network namespaces under our state, not the host's /run/netns.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$nstate/cni"
EOF
  # One bridge on the node's pod subnet; host-local IPAM keeps its leases in our state.
  cat > "$nstate/cni/10-phasesplit.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "phasesplit",
  "plugins": [
    {"type": "bridge", "bridge": "$bridge", "isGateway": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$nstate/cni-ipam",
              "ranges": [[{"subnet": "$pod_subnet", "gateway": "$node_ip"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "loopback"}
  ]
}
EOF
  local total_mem_k reserve_mem_m cpus
  cpus=$(nproc)
  total_mem_k=$(awk '/^MemTotal/ {print $2}' /proc/meminfo)
  # systemReserved = capacity - wanted allocatable (the kubelet subtracts it; eviction adds 100Mi).
  local want_mem_m=$(( $(numfmt --from=iec-i "${alloc_mem}" 2>/dev/null || numfmt --from=iec "${alloc_mem%i}") / 1048576 ))
  reserve_mem_m=$(( total_mem_k / 1024 - want_mem_m - 100 ))
  (( reserve_mem_m > 0 )) || reserve_mem_m=256
  local reserve_cpu_m=$(( cpus * 1000 - ${alloc_cpu_m%m} ))
  (( reserve_cpu_m > 0 )) || reserve_cpu_m=100
  # CoreDNS answers Service and pod names from the API (its kubernetes plugin) and forwards the rest
  # to the host's resolver; `ready` turns 200 once its Service/EndpointSlice caches have synced.
  cat > "$nstate/Corefile" <<EOF
.:53 {
    bind $node_ip
    errors
    ready 127.0.0.1:$dns_ready_port
    kubernetes $cluster_domain in-addr.arpa ip6.arpa {
        kubeconfig $nstate/coredns.kubeconfig phasesplit
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }
    forward . /etc/resolv.conf
    cache 5
    loop
}
EOF
  cat > "$nstate/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $node_ip
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $kubelet_healthz_port
# The API server here presents no kubelet client certificate (hack/cluster.sh), so kubectl logs
# and exec go through anonymously; the port is bound to the node's bridge address only.
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}, x509: {clientCAFile: "$ca"}}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix://$nstate/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: /$cgroup_root
failCgroupV1: false
oomScoreAdj: 0
failSwapOn: false
# Pods resolve names through the node's CoreDNS (hack/node.sh starts it before the kubelet).
clusterDNS: [$node_ip]
clusterDomain: $cluster_domain
podLogsDir: $nstate/pod-logs
registerWithTaints:
- {key: $label_key, value: "true", effect: NoSchedule}
systemReserved: {cpu: ${reserve_cpu_m}m, memory: ${reserve_mem_m}Mi}
enforceNodeAllocatable: [pods]
maxPods: 20
# Images are imported, never pulled: never garbage-collect them; the disk may sit near the default
# eviction thresholds, and evicting serving pods for it would only confuse the tests.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
serializeImagePulls: false
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
EOF
  cat > "$nstate/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$nstate/kube-proxy.kubeconfig"}
hostnameOverride: $node_name
mode: nftables
clusterCIDR: $pod_subnet
healthzBindAddress: 127.0.0.1:$proxy_healthz_port
metricsBindAddress: 127.0.0.1:$proxy_metrics_port
# Leave the host's conntrack sysctls alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
}

# Pods reach the API server as the `kubernetes` Service (10.96.0.1:443). The API server listens on
# loopback only, so a relay on the node's bridge address forwards to it, and the Service's
# EndpointSlice (the API server's own reconciler is off, see cluster.sh) points at the relay.
apiserver_relay() {
  local port
  port=$(apiserver_url); port=${port##*:}
  start apiserver-relay socat "TCP-LISTEN:$port,bind=$node_ip,fork,reuseaddr" "TCP:127.0.0.1:$port"
  kubectl_ apply -f - >/dev/null <<EOF
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubernetes-phasesplit-node
  namespace: default
  labels: {kubernetes.io/service-name: kubernetes, endpointslice.kubernetes.io/managed-by: phasesplit-node}
addressType: IPv4
endpoints:
- addresses: ["$node_ip"]
  conditions: {ready: true}
ports:
- {name: https, port: $port, protocol: TCP}
EOF
}

# CoreDNS reads Services, EndpointSlices, namespaces and pods: a user with just that (the RBAC
# that kubeadm gives its CoreDNS), removed again by `down`.
dns_rbac() {
  kubectl_ apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "phasesplit-node:coredns", labels: {app.kubernetes.io/managed-by: phasesplit-node}}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "phasesplit-node:coredns", labels: {app.kubernetes.io/managed-by: phasesplit-node}}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "phasesplit-node:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "$dns_user"}
EOF
}

up() {
  [[ $(id -u) == 0 ]] || die "the node runs containers: run as root"
  bash "$root/hack/cluster.sh" status >/dev/null 2>&1 || die "no cluster in $cstate: hack/cluster.sh up first"
  if [[ -d $nstate ]]; then
    if ready; then say "reusing the running node in $nstate"; bash "$root/hack/cluster.sh" status; return; fi
    say "found a stale or half-started node in $nstate; cleaning it up"
    down
  fi
  for c in containerd runc socat nft /usr/lib/cni/bridge; do
    [[ $c == /* && -x $c ]] || command -v "$c" >/dev/null \
      || die "$c is missing (hack/setup.d/55-node-packages.sh installs it)"
  done
  local bin t0
  bin=$(bash "$root/hack/kube-tools.sh" node | tail -n 1)
  bash "$root/hack/images.sh" pause >/dev/null  # built (or found cached) before anything starts
  t0=$(date +%s.%N)

  mkdir -p "$nstate"/{pids,logs,pki,pod-logs,kubelet}
  trap 'exit 130' INT TERM
  trap 'if [[ ! -f $nstate/ready ]]; then say "start-up failed; cleaning up"; down; fi' EXIT
  snapshot_host
  read -r kubelet_port kubelet_healthz_port proxy_healthz_port proxy_metrics_port dns_ready_port <<<"$(free_ports 5)"

  # The bridge exists before the kubelet so that the node's address does (the CNI plugin reuses it).
  ip link add "$bridge" type bridge
  ip addr add "$node_ip/${pod_subnet#*/}" dev "$bridge"
  ip link set "$bridge" up
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 net.ipv4.ip_forward=1
  local d
  for d in $(cgroup_dirs); do
    mkdir -p "$d"
    # cpuset children start empty (v1): give ours the parent's CPUs and memory nodes.
    if [[ -f ${d%/*}/cpuset.cpus && ! -s $d/cpuset.cpus ]]; then
      cat "${d%/*}/cpuset.cpus" > "$d/cpuset.cpus"; cat "${d%/*}/cpuset.mems" > "$d/cpuset.mems"
    fi
  done

  mkdir -p "$model_cache" && chown "$runtime_uid:$runtime_uid" "$model_cache"

  leaf kubelet "/O=system:nodes/CN=system:node:$node_name"
  leaf kube-proxy "/CN=system:kube-proxy"
  leaf coredns "/CN=$dns_user"
  write_configs

  start containerd containerd --config "$nstate/containerd/config.toml"
  wait_for containerd 30 containerd ctr_ version
  PHASESPLIT_CLUSTER_DIR=$cstate bash "$root/hack/images.sh" --import pause >/dev/null
  apiserver_relay
  dns_rbac
  # Before the kubelet, so that the first pod's lookups already find it.
  start coredns "$bin/coredns" -conf "$nstate/Corefile"
  wait_for "CoreDNS to sync with the API" 60 coredns curl -fsS "http://127.0.0.1:$dns_ready_port/ready"

  start kubelet "$bin/kubelet" --config="$nstate/kubelet.yaml" --kubeconfig="$nstate/kubelet.kubeconfig" \
    --hostname-override="$node_name" --node-ip="$node_ip" --root-dir="$nstate/kubelet" \
    --node-labels="$label_key=true" --v=1
  wait_for "the node to be Ready" 120 kubelet node_ready
  start kube-proxy "$bin/kube-proxy" --config="$nstate/kube-proxy.yaml" --v=1
  wait_for kube-proxy 60 kube-proxy curl -fsS "http://127.0.0.1:$proxy_healthz_port/healthz"

  touch "$nstate/ready"
  say "node $node_name up in $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}") s" \
    "(allocatable cpu $(kubectl_ get node $node_name -o 'jsonpath={.status.allocatable.cpu}')," \
    "memory $(kubectl_ get node $node_name -o 'jsonpath={.status.allocatable.memory}'); state in $nstate)"
  bash "$root/hack/cluster.sh" status
}

# stop_pid NAME: SIGTERM, up to 15 s, then SIGKILL.
stop_pid() {
  local pid
  pid=$(cat "$nstate/pids/$1" 2>/dev/null) || return 0
  kill -0 "$pid" 2>/dev/null || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then say "$1 (pid $pid) ignored SIGTERM; killing it"; kill -9 "$pid" 2>/dev/null || true; fi
  say "stopped $1 (pid $pid)"
}

# Pods first, through the API (the kubelet stops their containers and tears their network down
# with CNI DEL), then the daemons; whatever survives is removed by hand below.
drain() {
  kubectl_ get node "$node_name" >/dev/null 2>&1 || return 0
  kubectl_ cordon "$node_name" >/dev/null 2>&1 || true
  kubectl_ delete pods -A --field-selector "spec.nodeName=$node_name" --grace-period=5 --wait=false >/dev/null 2>&1 || true
  local t0; t0=$(date +%s)
  while (( $(date +%s) - t0 < 60 )); do
    [[ -z $(kubectl_ get pods -A --field-selector "spec.nodeName=$node_name" -o name 2>/dev/null) ]] \
      && [[ -z $(ctr_ tasks ls -q 2>/dev/null) ]] && break
    sleep 0.5
  done
  # Sandboxes: the kubelet removes them on its own schedule; ask it by waiting a little for none.
  kubectl_ delete node "$node_name" --wait=false >/dev/null 2>&1 || true
}

# The API objects `up` made besides the node (whether or not the kubelet still runs).
forget_api_objects() {
  [[ -f $cstate/kubeconfig ]] || return 0
  kubectl_ -n default delete endpointslice kubernetes-phasesplit-node --ignore-not-found >/dev/null 2>&1 || true
  kubectl_ delete clusterrolebinding,clusterrole -l app.kubernetes.io/managed-by=phasesplit-node \
    --ignore-not-found >/dev/null 2>&1 || true
}

down() {
  [[ -d $nstate ]] || { say "no node in $nstate"; return 0; }
  local bin=""
  [[ -f $cstate/bin-dir ]] && bin=$(cat "$cstate/bin-dir")
  if is_ours kubelet "kubelet " && [[ -f $cstate/kubeconfig ]]; then drain; fi
  forget_api_objects
  stop_pid kube-proxy
  [[ -x $bin/kube-proxy ]] && "$bin/kube-proxy" --cleanup >/dev/null 2>&1 || true
  stop_pid kubelet
  stop_pid coredns
  stop_pid apiserver-relay
  if is_ours containerd "containerd --config"; then
    # Whatever the kubelet left: kill tasks, delete containers (their snapshots unmount).
    local id
    for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
    sleep 0.5
    for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$id" >/dev/null 2>&1 || true; done
    for id in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers delete "$id" >/dev/null 2>&1 || true; done
  fi
  stop_pid containerd
  # Shims outlive containerd by design; ours name our socket.
  local pid
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $nstate/containerd/containerd.sock" || true); do
    kill -9 "$pid" 2>/dev/null || true
  done
  # Any process still in our cgroups (a container whose shim died), then the cgroups themselves.
  local d
  for d in $(cgroup_dirs); do
    [[ -d $d ]] || continue
    find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  done
  sleep 0.2
  for d in $(cgroup_dirs); do
    [[ -d $d ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
    [[ -d $d ]] && say "warning: could not remove cgroup $d"
  done
  # Mounts under our state and image store (deepest first), and netns the CRI made for our pods.
  local m
  for m in $(awk -v a="$nstate" -v b="$croot" '$5 ~ "^"a || $5 ~ "^"b {print $5}' /proc/self/mountinfo | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  if [[ -d /run/netns ]]; then
    for m in $(ls /run/netns); do
      grep -qx "$m" "$nstate/host/netns" 2>/dev/null && continue
      umount -l "/run/netns/$m" 2>/dev/null || true; rm -f "/run/netns/$m"
    done
  fi
  ip link del "$bridge" 2>/dev/null || true
  # Rules: back to the snapshot taken before `up` (kube-proxy's, the kubelet's and CNI's tables).
  if [[ -f $nstate/host/nft.rules ]]; then
    { echo "flush ruleset"; cat "$nstate/host/nft.rules"; } | nft -f - || say "warning: could not restore the nftables ruleset"
  fi
  local s
  for s in "${sysctls[@]}"; do
    [[ -s $nstate/host/$s ]] && sysctl -qw "$s=$(cat "$nstate/host/$s")" 2>/dev/null || true
  done
  # Shared host paths the node created (containerd's runc/shim sockets, CNI's cache, log links).
  local p
  find /var/log/containers -maxdepth 1 -lname "$nstate/*" -delete 2>/dev/null || true
  for p in /run/containerd /var/lib/cni /var/log/containers /run/netns; do
    if [[ -e $p ]] && ! grep -qx "$p" "$nstate/host/existed" 2>/dev/null; then rm -rf "$p"; fi
  done
  rm -rf "$nstate"
  say "down; removed $nstate"
}

exec 9>"$cstate.node.lock"
flock 9

case ${1:-} in
  up) up ;;
  down) down ;;
  status) if ready; then bash "$root/hack/cluster.sh" status; else say "no ready node in $nstate"; exit 1; fi ;;
  *) echo "usage: $0 up | down | status" >&2; exit 2 ;;
esac
