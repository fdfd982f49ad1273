"""Fixtures for tests against a real Kubernetes control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager v1.20.2) with the LOCAL NODE AGENT test harness playing the kubelet.

Nothing here skips: when the binaries are missing, ``control_plane`` runs
``k8s/build-control-plane.sh`` (≈7 min, cached at /opt/flare-airflow/k8s-1.20.2/bin or
$FLARE_K8S_BIN); when the control plane cannot start, every test using it errors.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from flare_airflow_testing.k8s.audit import AuditLog
from flare_airflow_testing.k8s.control_plane import ControlPlane
from flare_airflow_testing.k8s.kube import wait_for
from flare_airflow_testing.k8s.node_agent import NodeAgent


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(tmp_path_factory.mktemp("k8s-control-plane"))
    cp.start()  # ControlPlaneError → the tests error; never a skip
    print(f"\n[k8s] control plane ready in {cp.start_seconds:.1f} s at {cp.server} (run dir {cp.run_dir})")
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def core(control_plane: ControlPlane) -> k8s.CoreV1Api:
    """CoreV1Api as the ``flare-admin`` user (what tests and clients use)."""
    return k8s.CoreV1Api(control_plane.api_client())


@pytest.fixture(scope="session")
def node_agent(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeAgent]:
    agent = NodeAgent(
        kubeconfig=control_plane.kubeconfig_path("node"),
        node_name="flare-node-1",
        work_dir=tmp_path_factory.mktemp("flare-node-1"),
    ).start()
    try:
        yield agent
    finally:
        agent.stop()
        assert not agent.running_processes(), "node agent left processes running"
        assert not agent.errors, "node agent errors:\n" + "\n".join(agent.errors)


@pytest.fixture(scope="session")
def audit(control_plane: ControlPlane) -> AuditLog:
    return AuditLog(control_plane.audit_log)


@contextlib.contextmanager
def fresh_namespace(core: k8s.CoreV1Api, label: str) -> Iterator[str]:
    """A new namespace named after ``label``. On exit the test FAILS if any pod is left in it; then it
    is deleted."""
    slug = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")[:40].strip("-")
    name = f"t-{slug}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
    # The controller-manager creates the default ServiceAccount shortly after; wait so that tests
    # (and KubernetesPodOperator) see a normal namespace.
    wait_for(lambda: core.list_namespaced_service_account(name).items, 30, what=f"default SA in {name}")
    yield name
    left = [f"{p.metadata.name} ({p.status.phase})" for p in core.list_namespaced_pod(name).items]
    core.delete_namespace(name)
    if left:
        pytest.fail(f"pods left in namespace {name} after the test: {', '.join(left)}")


@pytest.fixture
def namespace(core: k8s.CoreV1Api, node_agent: NodeAgent, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test (:func:`fresh_namespace`)."""
    with fresh_namespace(core, request.node.name) as name:
        yield name
