"""Test harness for a real Kubernetes control plane without a cluster (see ../../k8s/ and INFRA.md).

- :mod:`tests.k8s_harness.control_plane` starts etcd + kube-apiserver + kube-scheduler +
  kube-controller-manager (v1.20.2, built by ``k8s/build-control-plane.sh``) on loopback.
- :mod:`tests.k8s_harness.node_agent` is a LOCAL NODE AGENT test harness that plays the kubelet
  through the real API and runs each bound pod's command as a local process.
- :mod:`tests.k8s_harness.audit` reads the apiserver's audit log to count API requests.

Nothing here is part of the flare_airflow package; it exists only for tests and benchmarks.
Import the submodules directly (this package imports nothing, so ``control_plane`` stays stdlib-only).
"""
