"""A Kubernetes site job found again by its identity (job, run, round, site, try), on the real
control plane (the LOCAL NODE AGENT test harness plays the kubelet and runs the pod's command)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobIdentity, JobReturnCode, JobState
from flare_airflow.core.store import ModelStore
from flare_airflow_testing.k8s.control_plane import ControlPlane
from flare_airflow_testing.k8s.node_agent import NodeAgent
from tests.integration.k8s.test_kubernetes_launcher import GLOBAL, JOB, RUN, Sites, wait_running


@pytest.fixture
def sites(
    control_plane: ControlPlane, core: k8s.CoreV1Api, namespace: str, node_agent: NodeAgent, tmp_path: pathlib.Path
) -> Iterator[Sites]:
    store = ModelStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    write_artifact(store.global_model(JOB, RUN, 0), FLModel(params=GLOBAL))
    s = Sites(control_plane, core, namespace, store)
    try:
        yield s
    finally:
        s.cleanup()


def identity(site: str = "site-1", try_number: int = 1) -> JobIdentity:
    return JobIdentity(JOB, RUN, 1, site, try_number)


def test_a_launch_is_found_by_its_identity_and_watched_from_the_found_handle(
    sites: Sites, tmp_path: pathlib.Path
) -> None:
    launcher = sites.launcher()
    release = tmp_path / "release"
    launched = sites.launch(launcher, "site-1", "--release", str(release))
    wait_running(launched)

    # Another process knows only the identity: it finds the same pod, not another one.
    other = sites.launcher()
    found = other.find_job(identity())
    assert found is not None
    assert (found.name, found.uid) == (launched.name, launched.uid)
    assert found.poll() is JobReturnCode.UNKNOWN and found.state is JobState.RUNNING
    assert other.find_job(identity(try_number=2)) is None, "another try is another launch"
    assert other.find_job(identity(site="site-2")) is None
    assert other.find_job(JobIdentity(JOB, "manual__other", 1, "site-1", 1)) is None

    release.touch()
    assert found.wait(timeout=60) is JobReturnCode.SUCCESS, found.reason
    assert "update sent" in found.logs()
    assert sites.gone(launched), "the found handle deleted the finished pod"
    assert other.find_job(identity()) is None, "a deleted pod is found no more"


def test_a_failed_pod_kept_for_debugging_is_found_with_its_result(sites: Sites) -> None:
    launcher = sites.launcher(keep_pods=True)
    launched = sites.launch(launcher, "site-1", "--exit", "103")
    assert launched.wait(timeout=60) is JobReturnCode.CONFIG_ERROR
    found = sites.launcher(keep_pods=True).find_job(identity())
    assert found is not None and found.name == launched.name
    assert found.poll() is JobReturnCode.CONFIG_ERROR
    assert (found.state, found.reason) == (JobState.FAILED, "exit code 103 (CONFIG_ERROR)")
    assert not sites.gone(launched), "kept"
    sites.launcher().find_job(identity()).terminate()  # type: ignore[union-attr]
    assert sites.gone(launched)
