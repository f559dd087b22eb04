#!/usr/bin/env bash
# Regenerates the operator's derived files; unit and cluster tests fail when they are stale.
#   crds/serving.phasesplit.io_inferenceservices.yaml (+ the chart's copy)  from operator/api.py
#   manifests/install.yaml                                                   from charts/phasesplit
# Needs helm: $HELM, else helm on PATH, else the one hack/kube-tools.sh built.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${PHASESPLIT_CACHE:-$HOME/.cache/phasesplit}
cd "$root"
# Import this checkout's operator even where the cached venv's editable install points at another
# checkout (a worktree, a CI clone): a package dir on PYTHONPATH wins over the editable finder.
pkg=$(mktemp -d)
trap 'rm -rf "$pkg"' EXIT
mkdir "$pkg/phasesplit"
ln -s "$root/runtime" "$pkg/phasesplit/runtime"
ln -s "$root/operator" "$pkg/phasesplit/operator"
PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH} "$cache/venv/bin/python" -m phasesplit.operator.crdgen --write
helm=${HELM:-$(command -v helm || ls -1 "$cache"/kube/*/bin/helm 2>/dev/null | tail -n 1 || true)}
[[ -x $helm ]] || { echo "helm not found (set HELM=...)" >&2; exit 1; }
{
  echo "# The phasesplit operator: CRD, RBAC and Deployment in namespace phasesplit-system."
  echo "# Rendered from charts/phasesplit by hack/gen-operator.sh. Do not edit."
  echo "#   kubectl apply --server-side -f manifests/install.yaml"
  echo "---"
  echo "apiVersion: v1"
  echo "kind: Namespace"
  echo "metadata:"
  echo "  name: phasesplit-system"
  "$helm" template phasesplit charts/phasesplit --namespace phasesplit-system --include-crds --kube-version 1.30.0
} > manifests/install.yaml
echo "wrote manifests/install.yaml"
