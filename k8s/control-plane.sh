#!/usr/bin/env bash
# Start / stop a real Kubernetes control plane on loopback (etcd + kube-apiserver + kube-scheduler +
# kube-controller-manager v1.20.2) for tests and local experiments. Builds the binaries first when
# they are missing (k8s/build-control-plane.sh, ~7 min, cached).
#
#   k8s/control-plane.sh start [--port N]   # prints `export KUBECONFIG=...` lines; eval them
#   k8s/control-plane.sh env                # the same lines for a running control plane
#   k8s/control-plane.sh status             # exit 0 when every process is running
#   k8s/control-plane.sh stop               # kills every process group it started
#
# State lives in $FLARE_K8S_RUN_DIR (default /tmp/flare-k8s-run). No node runs pods until the local
# node agent (a test harness) is started:
#   .venv/bin/python -m flare_airflow_testing.k8s.node_agent --kubeconfig "$FLARE_K8S_RUN_DIR/kubeconfig-node.yaml"
# The implementation is flare_airflow_testing/k8s/control_plane.py (standard library only).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
cd "$REPO"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m flare_airflow_testing.k8s.control_plane "$@"
