"""Test harness for a real Kubernetes control plane without a cluster (see k8s/ at the repository root).

- :mod:`flare_airflow_testing.k8s.control_plane` starts etcd + kube-apiserver + kube-scheduler +
  kube-controller-manager (v1.20.2, built by ``k8s/build-control-plane.sh``) on loopback.
- :mod:`flare_airflow_testing.k8s.node_agent` is a LOCAL NODE AGENT test harness that plays the kubelet
  through the real API and runs each bound pod's command as a local process.
- :mod:`flare_airflow_testing.k8s.audit` reads the apiserver's audit log to count API requests.

Import the submodules directly (this package imports nothing, so ``control_plane`` stays stdlib-only).
"""
