"""The pod-state table (flare_airflow.launchers.kubernetes.state.map_pod)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client as k8s

from flare_airflow.core.exit_codes import map_exit
from flare_airflow.core.spec import JobReturnCode, JobState
from flare_airflow.launchers.kubernetes import (
    FAIL_FAST_REASONS,
)
from tests.unit.launchers.kubernetes.pods import (
    RC,
    mapped,
    pod,
)

UNSCHEDULABLE = ("False", "Unschedulable")


def test_a_vanished_pod_is_never_success() -> None:
    s = mapped(None)
    assert (s.state, s.return_code, s.done) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR, True)
    assert s.reason == "pod vanished (deleted or garbage-collected) before reporting a result"


@pytest.mark.parametrize("resource", ["cpu", "memory", "nvidia.com/gpu"])
def test_pending_for_lack_of_resources_waits_up_to_pending_timeout(resource: str) -> None:
    msg = f"0/1 nodes are available: 1 Insufficient {resource}."
    waiting = mapped(pod(age=299, scheduled=(*UNSCHEDULABLE, msg)), startup=10)
    assert (waiting.state, waiting.return_code, waiting.done) == (JobState.STARTING, RC.UNKNOWN, False)
    assert waiting.waiting_for_resources is True
    assert waiting.reason == msg
    failed = mapped(pod(age=301, scheduled=(*UNSCHEDULABLE, msg)))
    assert (failed.state, failed.return_code, failed.done) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR, True)
    assert failed.waiting_for_resources is False
    assert f"Insufficient {resource}" in failed.reason
    assert "pending_timeout=300s" in failed.reason


def test_pending_for_other_reasons_fails_after_startup_timeout() -> None:
    msg = "0/1 nodes are available: 1 node(s) didn't match node selector."
    early = mapped(pod(age=100, scheduled=(*UNSCHEDULABLE, msg)))
    assert (early.done, early.waiting_for_resources, early.state) == (False, False, JobState.STARTING)
    late = mapped(pod(age=121, scheduled=(*UNSCHEDULABLE, msg)))
    assert (late.state, late.return_code) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR)
    assert "startup_timeout=120s" in late.reason and "didn't match node selector" in late.reason
    creating = mapped(pod(age=121, waiting=("ContainerCreating", "")))
    assert creating.return_code is RC.INFRASTRUCTURE_ERROR
    assert creating.reason == "pod did not start within startup_timeout=120s: ContainerCreating"
    assert mapped(pod(age=119, waiting=("ContainerCreating", ""))).done is False
    assert mapped(pod(phase=None, age=0)).state is JobState.STARTING  # not even a phase yet


@pytest.mark.parametrize(("reason", "rc"), sorted(FAIL_FAST_REASONS.items()))
def test_image_config_and_crash_errors_fail_fast(reason: str, rc: JobReturnCode) -> None:
    phase = "Running" if reason == "CrashLoopBackOff" else "Pending"
    s = mapped(pod(phase, age=0.5, waiting=(reason, "what the kubelet said")))
    assert (s.state, s.return_code, s.done) == (JobState.FAILED, rc, True)
    assert s.reason == f"{reason}: what the kubelet said"
    assert rc is not RC.SUCCESS


def test_fail_fast_return_codes() -> None:
    assert FAIL_FAST_REASONS["ErrImagePull"] is RC.INFRASTRUCTURE_ERROR
    assert FAIL_FAST_REASONS["ImagePullBackOff"] is RC.INFRASTRUCTURE_ERROR
    assert FAIL_FAST_REASONS["InvalidImageName"] is RC.CONFIG_ERROR
    assert FAIL_FAST_REASONS["CreateContainerConfigError"] is RC.CONFIG_ERROR
    assert FAIL_FAST_REASONS["CrashLoopBackOff"] is RC.EXECUTION_ERROR


def event(reason: str, message: str, uid: str = "uid-1") -> k8s.CoreV1Event:
    return k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(name="e"),
        involved_object=k8s.V1ObjectReference(kind="Pod", name="p", uid=uid),
        reason=reason,
        message=message,
        type="Warning",
    )


def test_mount_failures_of_our_volumes_fail_fast() -> None:
    store = k8s.V1Volume(name="flare-store", host_path=k8s.V1HostPathVolumeSource(path="/nope", type="Directory"))
    token = k8s.V1Volume(name="kube-api-access-x1", projected=k8s.V1ProjectedVolumeSource(sources=[]))
    p = pod(age=2, waiting=("ContainerCreating", ""), volumes=(store, token))
    msg = 'MountVolume.SetUp failed for volume "flare-store" : hostPath type check failed: /nope is not a directory'
    s = mapped(p, (event("FailedMount", msg),))
    assert (s.state, s.return_code, s.done) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR, True)
    assert s.reason == f"FailedMount: {msg}"
    # The service-account token volume's transient warnings, other pods' events: keep waiting.
    transient = (
        'MountVolume.SetUp failed for volume "kube-api-access-x1" : object "ns"/"kube-root-ca.crt" not registered'
    )
    assert mapped(p, (event("FailedMount", transient),)).done is False
    assert mapped(p, (event("FailedMount", msg, uid="uid-of-an-older-pod"),)).done is False
    assert mapped(p, (event("BackOff", msg),)).done is False
    # Also when the message reaches the pod's status (a waiting message).
    in_status = pod(
        age=2,
        waiting=("ContainerCreating", "Unable to attach or mount volumes: unmounted volumes=[flare-store]"),
        volumes=(store,),
    )
    assert mapped(in_status).return_code is RC.INFRASTRUCTURE_ERROR


def test_running_and_succeeded() -> None:
    r = mapped(pod("Running", age=5000, running=True))  # no timeout once it runs
    assert (r.state, r.return_code, r.done, r.reason) == (JobState.RUNNING, RC.UNKNOWN, False, "")
    s = mapped(pod("Succeeded", terminated={"exit_code": 0, "reason": "Completed"}))
    assert (s.state, s.return_code, s.done, s.reason) == (JobState.SUCCEEDED, RC.SUCCESS, True, "")


@pytest.mark.parametrize(
    ("terminated", "rc", "reason"),
    [
        ({"exit_code": 1, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 1"),
        ({"exit_code": 3, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 3"),
        ({"exit_code": 9, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 9"),
        ({"exit_code": 101, "reason": "Error"}, RC.EXCEPTION, "exit code 101 (EXCEPTION)"),
        ({"exit_code": 102, "reason": "Error"}, RC.UNSAFE_COMPONENT, "exit code 102 (UNSAFE_COMPONENT)"),
        ({"exit_code": 103, "reason": "Error"}, RC.CONFIG_ERROR, "exit code 103 (CONFIG_ERROR)"),
        ({"exit_code": 104, "reason": "Error"}, RC.INFRASTRUCTURE_ERROR, "exit code 104 (INFRASTRUCTURE_ERROR)"),
        ({"exit_code": 127, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 127"),
        ({"exit_code": 137, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 137 (SIGKILL)"),
        ({"exit_code": 143, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 143 (SIGTERM)"),
        (
            {"exit_code": 137, "reason": "OOMKilled"},
            RC.EXECUTION_ERROR,
            "OOMKilled: the trainer exceeded its memory limit (exit code 137); raise resource_spec.memory",
        ),
        (
            {"exit_code": 128, "reason": "StartError", "message": "exec: not found"},
            RC.EXECUTION_ERROR,
            "exit code 128: StartError: exec: not found",
        ),
        (
            {"exit_code": 0, "reason": "Completed"},
            RC.EXECUTION_ERROR,
            "pod failed although the trainer exited 0 (Completed)",
        ),
    ],
)
def test_failed_pods_map_their_exit_code(terminated: dict[str, Any], rc: JobReturnCode, reason: str) -> None:
    s = mapped(pod("Failed", terminated=terminated))
    assert (s.state, s.return_code, s.done, s.reason) == (JobState.FAILED, rc, True, reason)


def test_exit_codes_map_like_the_process_backend() -> None:
    for code in range(1, 256):
        s = mapped(pod("Failed", terminated={"exit_code": code, "reason": "Error"}))
        assert s.return_code is map_exit(code, terminated=False)[1], code
        assert s.state is JobState.FAILED


def test_failed_without_a_trainer_exit() -> None:
    evicted = mapped(pod("Failed", reason="Evicted", message="The node was low on resource: memory."))
    assert (evicted.state, evicted.return_code) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR)
    assert evicted.reason == "pod failed before the trainer ran (Evicted: The node was low on resource: memory.)"
    assert mapped(pod("Failed")).reason == "pod failed before the trainer ran (no reason given)"
    # Only the last termination is known (the container is waiting again): it still counts.
    s = mapped(pod("Failed", waiting=("ContainerCreating", ""), last_terminated={"exit_code": 2, "reason": "Error"}))
    assert (s.return_code, s.reason) == (RC.EXECUTION_ERROR, "exit code 2")


def test_deletion_aborts_unfinished_pods_but_keeps_a_success() -> None:
    for p in (
        pod("Running", running=True, deleting=True),
        pod("Pending", deleting=True),
        pod("Failed", terminated={"exit_code": 143, "reason": "Error"}, deleting=True),
    ):
        s = mapped(p)
        assert (s.state, s.return_code, s.done) == (JobState.TERMINATED, RC.ABORTED, True)
        assert s.reason.startswith("pod deleted before it finished")
    assert mapped(pod("Succeeded", terminated={"exit_code": 0}, deleting=True)).state is JobState.SUCCEEDED


@pytest.mark.parametrize("phase", ["Unknown", "Evicting", ""])
def test_unknown_phases_are_never_success(phase: str) -> None:
    s = mapped(pod(phase or "Weird", running=True))
    assert (s.state, s.return_code, s.done) == (JobState.FAILED, RC.EXECUTION_ERROR, True)
    assert s.reason == f"unknown pod phase {phase or 'Weird'!r}"
