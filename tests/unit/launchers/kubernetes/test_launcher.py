"""KubernetesLauncher and KubernetesJobHandle against a fake API (flare_airflow.launchers.kubernetes.launcher)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from flare_airflow.core.config import KubernetesLaunchSpec, ResourceSpec
from flare_airflow.core.spec import JobState
from flare_airflow.launchers.kubernetes import (
    CONTAINER_NAME,
    KubernetesLauncher,
    pod_name,
)
from flare_airflow.launchers.process import LaunchError
from tests.unit.launchers.kubernetes.pods import (
    DONE,
    RC,
    RUNNING,
    STORE,
    _staging_job,
    site_job,
)


class FakeCore:
    """Just enough of CoreV1Api: pods by name, injected failures, a call log."""

    def __init__(self) -> None:
        self.pods: dict[str, k8s.V1Pod] = {}
        self.calls: list[str] = []
        self.read_failures: list[ApiException] = []
        self.create_error: ApiException | None = None
        self.log = "line 1\nline 2\n"
        self.on_delete = lambda name: self.pods.pop(name, None)

    def create_namespaced_pod(self, namespace: str, body: k8s.V1Pod, **kw: Any) -> k8s.V1Pod:
        self.calls.append("create")
        if self.create_error is not None:
            raise self.create_error
        body.metadata.uid = "uid-1"
        body.metadata.creation_timestamp = datetime.now(UTC)
        body.status = k8s.V1PodStatus(phase="Pending")
        self.pods[body.metadata.name] = body
        return body

    def read_namespaced_pod(self, name: str, namespace: str, **kw: Any) -> k8s.V1Pod:
        self.calls.append("read")
        if self.read_failures:
            raise self.read_failures.pop(0)
        if name not in self.pods:
            raise ApiException(status=404, reason="Not Found")
        return self.pods[name]

    def list_namespaced_event(self, namespace: str, **kw: Any) -> k8s.CoreV1EventList:
        self.calls.append("events")
        return k8s.CoreV1EventList(items=[])

    def read_namespaced_pod_log(self, name: str, namespace: str, **kw: Any) -> Any:
        self.calls.append("log")
        assert kw["_preload_content"] is False and kw["container"] == CONTAINER_NAME
        return type("Resp", (), {"data": self.log.encode()})()

    def delete_namespaced_pod(self, name: str, namespace: str, body: k8s.V1DeleteOptions, **kw: Any) -> None:
        self.calls.append(f"delete grace={body.grace_period_seconds}")
        assert body.preconditions.uid == "uid-1"
        self.on_delete(name)

    def set_phase(self, name: str, phase: str, **container: Any) -> None:
        p = self.pods[name]
        state = k8s.V1ContainerState(**container)
        p.status = k8s.V1PodStatus(
            phase=phase,
            container_statuses=[
                k8s.V1ContainerStatus(
                    name=CONTAINER_NAME, image="x", image_id="", ready=True, restart_count=0, state=state
                )
            ],
        )


def launcher(fake: FakeCore, **spec: Any) -> KubernetesLauncher:
    out = KubernetesLauncher(
        KubernetesLaunchSpec(image="x", namespace="fl", poll_interval=0.01, **spec),
        ResourceSpec(),
        api_client=k8s.ApiClient(),
    )
    out.core = fake  # type: ignore[assignment]
    return out


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (422, "the API refused the pod"),
        (409, "a pod with this name already exists"),
        (403, "creating the pod failed (HTTP 403)"),
    ],
)
def test_launch_errors_carry_the_apis_message(status: int, expected: str) -> None:
    fake = FakeCore()
    fake.create_error = ApiException(status=status, reason="x")
    fake.create_error.body = json.dumps({"message": f'Pod "p" is invalid: spec.x: {status} from the API'})
    with pytest.raises(LaunchError) as info:
        launcher(fake).launch_job(site_job())
    assert expected in str(info.value)
    assert f"{status} from the API" in str(info.value)
    assert "digits/site-1/r3" in str(info.value)


def test_success_reads_the_log_and_deletes_the_pod() -> None:
    fake = FakeCore()
    lines: list[str] = []
    ln = launcher(fake)
    ln.sink = lines.append
    handle = ln.launch_job(site_job(), {"try_number": 4})
    assert handle.name.startswith("fl-digits-site-1-r3-") and handle.name == pod_name(
        "digits", "site-1", 3, site_job().run_id, 4
    )
    assert handle.poll() is RC.UNKNOWN and handle.state is JobState.STARTING
    fake.set_phase(handle.name, "Running", **RUNNING)
    assert handle.poll() is RC.UNKNOWN and handle.state is JobState.RUNNING
    fake.set_phase(handle.name, "Succeeded", **DONE)
    assert handle.wait(timeout=5) is RC.SUCCESS
    assert (handle.state, handle.reason) == (JobState.SUCCEEDED, "")
    assert handle.name not in fake.pods
    assert handle.logs() == "line 1\nline 2\n"  # kept after the deletion
    assert lines == ["[site-1 r3] line 1", "[site-1 r3] line 2"]
    assert fake.calls.count("log") == 1
    assert "delete grace=None" in fake.calls
    calls = len(fake.calls)
    assert handle.poll() is RC.SUCCESS and len(fake.calls) == calls  # final: no more API calls


def test_keep_pods_keeps_a_finished_pod() -> None:
    fake = FakeCore()
    handle = launcher(fake, keep_pods=True).launch_job(site_job())
    fake.set_phase(handle.name, "Failed", terminated=k8s.V1ContainerStateTerminated(exit_code=103, reason="Error"))
    assert handle.wait(timeout=5) is RC.CONFIG_ERROR
    assert handle.reason == "exit code 103 (CONFIG_ERROR)"
    assert handle.name in fake.pods
    assert not [c for c in fake.calls if c.startswith("delete")]


def test_transient_api_errors_are_retried_and_404_means_vanished() -> None:
    fake = FakeCore()
    handle = launcher(fake).launch_job(site_job())
    fake.set_phase(handle.name, "Running", **RUNNING)
    fake.read_failures = [ApiException(status=503, reason="Unavailable"), ApiException(status=500, reason="x")]
    assert handle.poll() is RC.UNKNOWN
    assert fake.calls.count("read") == 3
    fake.read_failures = [ApiException(status=403, reason="Forbidden")]  # not transient: raised at once
    with pytest.raises(ApiException):
        handle.poll()
    del fake.pods[handle.name]
    assert handle.poll() is RC.INFRASTRUCTURE_ERROR
    assert handle.reason == "pod vanished (deleted or garbage-collected) before reporting a result"
    assert not [c for c in fake.calls if c.startswith("delete")]


def test_terminate_deletes_with_the_shutdown_grace_and_waits_until_gone() -> None:
    fake = FakeCore()
    handle = launcher(fake).launch_job(site_job(shutdown_timeout=4.2))
    fake.set_phase(handle.name, "Running", **RUNNING)
    assert handle.poll() is RC.UNKNOWN
    reads_left = {"n": 3}

    def slow_delete(name: str) -> None:  # the pod stays for a few reads, as while its process stops
        def read_until_gone(n=name, ns="fl", **kw):
            fake.calls.append("read")
            reads_left["n"] -= 1
            if reads_left["n"] < 0:
                raise ApiException(status=404, reason="Not Found")
            return fake.pods[n]

        fake.read_namespaced_pod = read_until_gone  # type: ignore[method-assign]

    fake.on_delete = slow_delete
    handle.terminate()
    assert "delete grace=5" in fake.calls
    assert reads_left["n"] < 0  # waited until the API said the pod is gone
    assert (handle.state, handle.poll(), handle.reason) == (
        JobState.TERMINATED,
        RC.ABORTED,
        "terminated: pod deleted on request",
    )
    assert handle.logs() == "line 1\nline 2\n"
    handle.terminate()  # idempotent


def test_terminate_keeps_a_result_that_is_already_there() -> None:
    fake = FakeCore()
    handle = launcher(fake).launch_job(site_job())
    fake.set_phase(handle.name, "Succeeded", **DONE)
    handle.terminate()
    assert (handle.state, handle.poll()) == (JobState.SUCCEEDED, RC.SUCCESS)
    assert handle.name not in fake.pods


def test_wait_with_a_timeout_returns_unknown_while_pending() -> None:
    fake = FakeCore()
    handle = launcher(fake).launch_job(site_job())
    assert handle.wait(timeout=0.1) is RC.UNKNOWN
    assert handle.state is JobState.STARTING
    assert handle.name in fake.pods


def test_the_launcher_creates_the_output_directory_before_the_pod(tmp_path) -> None:
    # Otherwise the kubelet creates the subPath directory owned by root, unwritable for UID 1000.
    root = tmp_path / "store"
    job = _staging_job()
    env = {k: v.replace(STORE, str(root)) for k, v in job.env.items()}
    fake = FakeCore()
    ln = launcher(fake, store_mount={"pvc": "store"})
    ln.store_root = str(root)
    ln.launch_job(site_job(env=env))
    assert (root / "digits/run/round-0003/staging/site-1/try-2").is_dir()
    assert not (root / "digits/run/round-0002").exists(), "the input is the Airflow side's to write"
    assert fake.calls == ["create"]
