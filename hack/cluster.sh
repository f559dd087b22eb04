#!/usr/bin/env bash
# A real local Kubernetes control plane for tests and development, no containers needed:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (which plays the kubelet
# for fake GPU nodes), all built from source by hack/kube-tools.sh.
#
#   hack/cluster.sh up      start it (or reuse the running one); prints `export KUBECONFIG=...`
#                           and `export PATH=...` lines on stdout, so: eval "$(hack/cluster.sh up)"
#   hack/cluster.sh down    stop every process `up` started and remove its state (refused while
#                           test sessions use the cluster, unless given --force)
#   hack/cluster.sh status  exit 0 and print the exports if it is up and ready, else exit 1
#
# State (certificates, etcd data, logs, kubeconfig) lives in
#   ${PHASESPLIT_CLUSTER_DIR:-${TMPDIR:-/tmp}/phasesplit-cluster-$UID}
# so separate checkouts or users can run separate clusters by setting that variable.
#
# The fake nodes (two, 8 nvidia.com/gpu each) are NOT tainted: workloads the operator renders must
# schedule onto them exactly as onto real GPU nodes, without test-only tolerations.
set -euo pipefail
# free_ports, pid_runs: hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
state=${PHASESPLIT_CLUSTER_DIR:-${TMPDIR:-/tmp}/phasesplit-cluster-$(id -u)}
nodes=${PHASESPLIT_CLUSTER_NODES:-2}
gpus_per_node=${PHASESPLIT_CLUSTER_GPUS:-8}
# Client QPS of the controller-manager's controllers and of the scheduler (their defaults: 20 and
# 50). Raise it for scale experiments (tests/bench/operator_scale.py), where thousands of pods
# are created and bound at once and those limits, not the operator, would set the pace.
api_qps=${PHASESPLIT_CLUSTER_QPS:-}
service_cidr=10.96.0.0/16
service_ip=10.96.0.1  # first address of service_cidr: the `kubernetes` Service, in the serving cert
pod_cidr=10.244.0.0/16

say() { echo "[cluster] $*" >&2; }
die() { say "error: $*"; exit 1; }

components=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

# is_ours NAME: the pid recorded for NAME is alive and still runs our binary (pid_runs: hack/lib.sh).
is_ours() { pid_runs "$state/pids/$1" "/$1 "; }

exports() {
  local bin
  bin=$(cat "$state/bin-dir")
  echo "export KUBECONFIG=$state/kubeconfig"
  echo "export PATH=$bin:\$PATH"
}

kubectl_() { "$(cat "$state/bin-dir")/kubectl" --kubeconfig "$state/kubeconfig" "$@"; }

ready() {
  [[ -f $state/ready ]] || return 1
  local c
  for c in "${components[@]}"; do is_ours "$c" || return 1; done
  kubectl_ get --raw /readyz >/dev/null 2>&1
}

# stop_group NAME...: SIGTERM to each (those still ours), then waits for all of them together;
# SIGKILL for any that outlast 10 s.
stop_group() {
  local c pids=() names=()
  for c in "$@"; do
    if is_ours "$c"; then
      pids+=("$(cat "$state/pids/$c")"); names+=("$c")
      kill "${pids[-1]}" 2>/dev/null || true
    fi
  done
  local i left
  for _ in $(seq 100); do
    left=0
    for i in "${pids[@]}"; do kill -0 "$i" 2>/dev/null && left=1; done
    (( left )) || break
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    if kill -0 "${pids[i]}" 2>/dev/null; then
      say "${names[i]} (pid ${pids[i]}) ignored SIGTERM for 10 s; killing it"
      kill -9 "${pids[i]}" 2>/dev/null || true
    fi
    say "stopped ${names[i]} (pid ${pids[i]})"
  done
}

stop() {
  [[ -d $state ]] || return 0
  # A real node (hack/node.sh) joined to this control plane goes first: it needs the API server
  # to drain its pods.
  if [[ -d $state/node ]]; then bash "$root/hack/node.sh" down || say "warning: hack/node.sh down failed"; fi
  # Clients first, etcd last, so nothing waits on or logs errors about a vanished server.
  stop_group kwok kube-scheduler kube-controller-manager
  stop_group kube-apiserver
  stop_group etcd
  rm -rf "$state"
}


# wait_for WHAT SECONDS CMD...: polls CMD until it succeeds; on timeout shows the logs and fails.
wait_for() {
  local what=$1 limit=$2 t0; shift 2
  t0=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    if (( $(date +%s) - t0 >= limit )); then
      say "timed out after ${limit}s waiting for $what; last log lines:"
      local c
      for c in "${components[@]}"; do
        [[ -f $state/logs/$c.log ]] && { echo "--- $c" >&2; tail -n 15 "$state/logs/$c.log" >&2; }
      done
      return 1
    fi
    sleep 0.2
  done
}

# start NAME ARGS...: runs the cached binary NAME in its own session (so it outlives this script
# and the caller's terminal or test runner), logging to logs/NAME.log.
start() {
  local name=$1; shift
  # 9>&-: the daemons must not inherit (and so hold forever) the lock taken below on fd 9.
  setsid "$bin/$name" "$@" > "$state/logs/$name.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$state/pids/$name"
  say "started $name (pid $!)"
}

gen_certs() {
  local d=$state/pki
  mkdir -p "$d"
  # ECDSA P-256: instant to generate, and every component accepts it.
  openssl ecparam -name prime256v1 -genkey -noout -out "$d/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$d/ca.key" -subj "/CN=phasesplit-local-ca" -days 3650 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$d/ca.crt" 2>/dev/null
  # leaf NAME SUBJECT EXTENSIONS
  leaf() {
    openssl ecparam -name prime256v1 -genkey -noout -out "$d/$1.key" 2>/dev/null
    openssl req -new -key "$d/$1.key" -subj "$2" 2>/dev/null \
      | openssl x509 -req -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 365 \
        -extfile <(printf '%s\n' "keyUsage=critical,digitalSignature,keyEncipherment" "$3") -out "$d/$1.crt" 2>/dev/null
  }
  leaf apiserver "/CN=kube-apiserver" "extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:$service_ip,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  # Client identities the default RBAC roles are bound to.
  leaf admin "/O=system:masters/CN=phasesplit-admin" "extendedKeyUsage=clientAuth"
  leaf controller-manager "/CN=system:kube-controller-manager" "extendedKeyUsage=clientAuth"
  leaf scheduler "/CN=system:kube-scheduler" "extendedKeyUsage=clientAuth"
  # The service-account token signing key (RSA: what every token verifier expects by default).
  openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
  openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
}

# kubeconfig FILE IDENTITY: a kubeconfig with embedded certificates for one client identity.
kubeconfig() {
  local d=$state/pki
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: phasesplit
  cluster:
    server: https://127.0.0.1:$apiserver_port
    certificate-authority-data: $(base64 -w0 < "$d/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(base64 -w0 < "$d/$2.crt")
    client-key-data: $(base64 -w0 < "$d/$2.key")
contexts:
- name: phasesplit
  context: {cluster: phasesplit, user: $2}
current-context: phasesplit
EOF
}

fake_nodes() {
  local i
  for ((i = 0; i < nodes; i++)); do
    cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: kwok-gpu-$i
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    kubernetes.io/hostname: kwok-gpu-$i
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    node.kubernetes.io/instance-type: fake-gpu-$gpus_per_node
    nvidia.com/gpu.present: "true"
    nvidia.com/gpu.count: "$gpus_per_node"
    nvidia.com/gpu.product: kwok-fake-gpu
spec: {}
status:
  capacity: &res
    cpu: "64"
    memory: 512Gi
    ephemeral-storage: 1Ti
    pods: "110"
    nvidia.com/gpu: "$gpus_per_node"
  allocatable: *res
  nodeInfo:
    architecture: amd64
    operatingSystem: linux
    kubeletVersion: fake
    kernelVersion: fake
    osImage: fake
    containerRuntimeVersion: fake
EOF
  done
}

# Every fake node Ready and free of taints (the node lifecycle controller lifts the not-ready
# taint that admission puts on new nodes), i.e. the scheduler will place pods there.
nodes_schedulable() {
  local out
  out=$(kubectl_ get nodes -l type=kwok -o \
    'jsonpath={range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status} {.spec.taints}{"\n"}{end}') || return 1
  [[ $(grep -c . <<<"$out") -eq $nodes ]] || return 1
  ! grep -vqE '^[^ ]+ True $' <<<"$out"
}

up() {
  local t0
  t0=$(date +%s.%N)
  if [[ -d $state ]]; then
    if ready; then
      say "reusing the running cluster in $state"
      exports
      return
    fi
    say "found a stale or half-started cluster in $state; cleaning it up"
    stop
  fi

  bin=$(bash "$root/hack/kube-tools.sh" | tail -n 1)
  [[ -x $bin/kube-apiserver ]] || die "kube-tools.sh did not produce $bin"
  t0=$(date +%s.%N)  # the build (cached or not) is not start-up time

  mkdir -p "$state"/{pids,logs,etcd}
  echo "$bin" > "$state/bin-dir"
  # If anything below fails or is interrupted, leave nothing running.
  trap 'exit 130' INT TERM
  trap 'if [[ ! -f $state/ready ]]; then say "start-up failed; stopping what was started"; stop; fi' EXIT

  read -r etcd_port etcd_peer_port apiserver_port kcm_port sched_port <<<"$(free_ports 5)"
  gen_certs
  kubeconfig "$state/kubeconfig" admin
  kubeconfig "$state/controller-manager.kubeconfig" controller-manager
  kubeconfig "$state/scheduler.kubeconfig" scheduler

  # --unsafe-no-fsync: throwaway test data; fsync dominates etcd latency on CI disks.
  start etcd --name=phasesplit --data-dir="$state/etcd" \
    --listen-client-urls="http://127.0.0.1:$etcd_port" --advertise-client-urls="http://127.0.0.1:$etcd_port" \
    --listen-peer-urls="http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls="http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster="phasesplit=http://127.0.0.1:$etcd_peer_port" \
    --unsafe-no-fsync --log-level=warn
  wait_for "etcd" 30 curl -fsS "http://127.0.0.1:$etcd_port/health"

  local pki=$state/pki
  # A real node (hack/node.sh) is reached by its InternalIP: nothing resolves node names here.
  # Bound to loopback only. The `kubernetes` Service's Endpoints may not hold a loopback address,
  # so its reconciler is off (nothing in-cluster dials the API server: kwok runs no containers).
  # The requestheader flags publish a front-proxy CA (no such client certificate is ever issued) so
  # the controller-manager's and scheduler's delegated authentication finds a complete config.
  start kube-apiserver \
    --etcd-servers="http://127.0.0.1:$etcd_port" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$apiserver_port" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" \
    --authorization-mode=Node,RBAC \
    --service-cluster-ip-range="$service_cidr" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
    --requestheader-client-ca-file="$pki/ca.crt" --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --endpoint-reconciler-type=none \
    --allow-privileged=true \
    --kubelet-preferred-address-types=InternalIP,Hostname \
    --cert-dir="$state/apiserver-certs"
  wait_for "kube-apiserver /readyz" 60 kubectl_ get --raw /readyz

  # Leader election off: a single replica of each, and no lease wait on start.
  start kube-controller-manager \
    --kubeconfig="$state/controller-manager.kubeconfig" \
    --authentication-kubeconfig="$state/controller-manager.kubeconfig" \
    --authorization-kubeconfig="$state/controller-manager.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$kcm_port" --leader-elect=false \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
    --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
    --controllers='*' --node-monitor-period=1s \
    ${api_qps:+--kube-api-qps=$api_qps --kube-api-burst=$((api_qps * 2))}
  start kube-scheduler \
    --kubeconfig="$state/scheduler.kubeconfig" \
    --authentication-kubeconfig="$state/scheduler.kubeconfig" \
    --authorization-kubeconfig="$state/scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$sched_port" --leader-elect=false \
    ${api_qps:+--kube-api-qps=$api_qps --kube-api-burst=$((api_qps * 2))}
  # kwok keeps the annotated nodes Ready (lease heartbeats) and plays the kubelet for pods bound
  # to them, following hack/kube/kwok-stages.yaml: Running and Ready at once, deleted when asked.
  start kwok --kubeconfig="$state/kubeconfig" --config="$root/hack/kube/kwok-stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --cidr="$pod_cidr" --node-ip=10.0.0.1 --node-lease-duration-seconds=40

  fake_nodes | kubectl_ apply -f - >/dev/null
  say "created $nodes fake nodes with $gpus_per_node nvidia.com/gpu each"
  wait_for "the fake nodes to be Ready and untainted" 60 nodes_schedulable
  # Pods are admitted only once their namespace's `default` ServiceAccount exists.
  wait_for "the default ServiceAccount" 60 kubectl_ -n default get serviceaccount default

  touch "$state/ready"
  say "cluster up in $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}") s" \
    "(kubernetes $(grep ^kubernetes= "$bin/../versions" | cut -d= -f2), state in $state)"
  exports
}

# One `up`/`down` at a time (two test sessions may start together); the lock file sits next to
# the state directory because `down` removes the directory.
mkdir -p "$(dirname "$state")"
exec 9>"$state.lock"
flock 9

case ${1:-} in
  up) up ;;
  down)
    # Test sessions using the cluster hold a shared lock on users.lock (tests/kubecluster.py);
    # pulling it from under them would fail their tests in confusing ways.
    if [[ ${2:-} != --force && -e $state/users.lock ]] && ! flock -n -x "$state/users.lock" true; then
      die "test sessions are using the cluster in $state; let them finish, or: $0 down --force"
    fi
    if [[ -d $state ]]; then stop; say "down; removed $state"; else say "no cluster in $state"; fi ;;
  status)
    if ready; then exports; else say "no ready cluster in $state"; exit 1; fi ;;
  *) echo "usage: $0 up | down [--force] | status" >&2; exit 2 ;;
esac
