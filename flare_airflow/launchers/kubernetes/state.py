"""The Kubernetes backend's state table: a pod (or its absence) to what it means for the site job.

:func:`map_pod` is the one table (``docs/state-mapping.md``), used by the launcher's handle and
by the Airflow pod-state trigger alike, with NVIDIA FLARE's semantics: wait while Pending for
lack of cpu / memory / GPUs up to ``pending_timeout``, fail fast on image, configuration and
mount errors, never success for a pod that vanished or is in an unknown phase.
"""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from kubernetes import client as k8s

from flare_airflow.core.exit_codes import map_exit
from flare_airflow.core.spec import JobReturnCode, JobState, JobStatus
from flare_airflow.launchers.kubernetes.naming import CONTAINER_NAME

# Container waiting reasons that no amount of waiting fixes (the kubelet keeps retrying them, but a
# site job must fail with the reason instead of hanging until a timeout), and their return codes.
FAIL_FAST_REASONS: dict[str, JobReturnCode] = {
    "ErrImagePull": JobReturnCode.INFRASTRUCTURE_ERROR,
    "ImagePullBackOff": JobReturnCode.INFRASTRUCTURE_ERROR,
    "ErrImageNeverPull": JobReturnCode.INFRASTRUCTURE_ERROR,
    "InvalidImageName": JobReturnCode.CONFIG_ERROR,
    "CreateContainerConfigError": JobReturnCode.CONFIG_ERROR,
    "CreateContainerError": JobReturnCode.INFRASTRUCTURE_ERROR,
    "RunContainerError": JobReturnCode.INFRASTRUCTURE_ERROR,
    "CrashLoopBackOff": JobReturnCode.EXECUTION_ERROR,
}
_MOUNT_FAILURE_EVENTS = ("FailedMount", "FailedAttachVolume")
_MOUNT_FAILURE_TEXT = ("MountVolume.SetUp failed", "Unable to attach or mount volumes", "FailedMount")
_INSUFFICIENT = re.compile(r"Insufficient [\w./-]+|Too many pods")
_VANISHED = "pod vanished (deleted or garbage-collected) before reporting a result"


def _failed(rc: JobReturnCode, reason: str) -> JobStatus:
    return JobStatus(JobState.FAILED, rc, reason, done=True)


def container_statuses(status: Any) -> list[Any]:
    """The statuses of a pod's init containers and containers (``status`` is a ``V1PodStatus``)."""
    return list(status.init_container_statuses or []) + list(status.container_statuses or [])


def trainer_started(pod: k8s.V1Pod | None) -> bool:
    """Whether the trainer container ever ran (so that it has a log)."""
    if pod is None or pod.status is None:
        return False
    return any(
        s.state is not None and (s.state.running or s.state.terminated) for s in pod.status.container_statuses or []
    )


def _our_volumes(pod: k8s.V1Pod) -> list[str]:
    # Projected volumes (the service account token) are the kubelet's business; their transient
    # "not registered" mount warnings must not fail a job.
    return [v.name for v in (pod.spec.volumes if pod.spec else None) or [] if v.projected is None]


def _mount_failure(pod: k8s.V1Pod, events: Iterable[Any]) -> str | None:
    names = _our_volumes(pod)

    def about_ours(message: str) -> bool:
        return any(re.search(rf"(?<![-a-z0-9.]){re.escape(n)}(?![-a-z0-9.])", message) for n in names)

    uid = pod.metadata.uid if pod.metadata else None
    for event in events:
        involved = getattr(event, "involved_object", None)
        if uid and involved is not None and involved.uid not in (None, uid):
            continue
        message = event.message or ""
        if event.reason in _MOUNT_FAILURE_EVENTS and about_ours(message):
            return f"{event.reason}: {message}"
    status = pod.status
    messages = [c.message for c in (status.conditions or []) if c.message] if status else []
    messages += [
        s.state.waiting.message
        for s in (container_statuses(status) if status else [])
        if s.state and s.state.waiting and s.state.waiting.message
    ]
    for message in messages:
        if any(marker in message for marker in _MOUNT_FAILURE_TEXT) and about_ours(message):
            return f"FailedMount: {message}"
    return None


def _exit_status(term: Any) -> JobStatus:
    code = term.exit_code
    detail = f"{term.reason}: {term.message}" if term.message else (term.reason or "")
    if term.reason == "OOMKilled":
        return _failed(
            JobReturnCode.EXECUTION_ERROR,
            f"OOMKilled: the trainer exceeded its memory limit (exit code {code}); raise resource_spec.memory",
        )
    if code is None:
        return _failed(JobReturnCode.EXECUTION_ERROR, f"trainer terminated without an exit code ({detail or '?'})")
    if code == 0:
        # The pod failed although the trainer exited 0 (e.g. a sidecar failed): not a success.
        return _failed(JobReturnCode.EXECUTION_ERROR, f"pod failed although the trainer exited 0 ({detail or '?'})")
    _state, rc, reason = map_exit(code, terminated=False)
    if 128 < code < 160:
        with contextlib.suppress(ValueError):
            reason += f" ({signal.Signals(code - 128).name})"
    if detail and term.reason not in ("Error", "Completed"):
        reason += f": {detail}"
    return _failed(rc, reason)


def _trainer_termination(status: Any) -> Any:
    """The trainer container's termination record (current state first, then the last one)."""
    statuses = list(status.container_statuses or [])
    for s in [s for s in statuses if s.name == CONTAINER_NAME] or statuses[:1]:
        for state in (s.state, s.last_state):
            if state is not None and state.terminated is not None:
                return state.terminated
    return None


def map_pod(
    pod: k8s.V1Pod | None,
    *,
    now: datetime,
    pending_timeout: float,
    startup_timeout: float,
    events: Sequence[Any] = (),
) -> JobStatus:
    """The state table of the Kubernetes backend (``docs/state-mapping.md``).

    ``pod`` is the pod as read now, ``None`` when the API says it does not exist (404). ``events``
    are optional Warning events of the pod (``FailedMount`` fails fast: a volume that cannot be
    mounted). An unknown phase is never success.
    """
    if pod is None:
        return _failed(JobReturnCode.INFRASTRUCTURE_ERROR, _VANISHED)
    meta, status = pod.metadata, pod.status or k8s.V1PodStatus()
    phase = status.phase or "Pending"
    if phase == "Succeeded":
        return JobStatus(JobState.SUCCEEDED, JobReturnCode.SUCCESS, "", done=True)
    if meta is not None and meta.deletion_timestamp is not None:
        return JobStatus(
            JobState.TERMINATED,
            JobReturnCode.ABORTED,
            f"pod deleted before it finished (deletionTimestamp {meta.deletion_timestamp.isoformat()})",
            done=True,
        )
    if phase == "Failed":
        term = _trainer_termination(status)
        if term is not None:
            return _exit_status(term)
        why = ": ".join(x for x in (status.reason, status.message) if x) or "no reason given"
        return _failed(JobReturnCode.INFRASTRUCTURE_ERROR, f"pod failed before the trainer ran ({why})")
    if phase not in ("Pending", "Running"):
        return _failed(JobReturnCode.EXECUTION_ERROR, f"unknown pod phase {phase!r}")
    for s in container_statuses(status):
        waiting = s.state.waiting if s.state else None
        if waiting is not None and waiting.reason in FAIL_FAST_REASONS:
            message = f": {waiting.message}" if waiting.message else ""
            return _failed(FAIL_FAST_REASONS[waiting.reason], f"{waiting.reason}{message}")
    if phase == "Running":
        return JobStatus(JobState.RUNNING, JobReturnCode.UNKNOWN, "", done=False)
    mount = _mount_failure(pod, events)
    if mount is not None:
        return _failed(JobReturnCode.INFRASTRUCTURE_ERROR, mount)
    created = meta.creation_timestamp if meta is not None else None
    pending_for = (now - created).total_seconds() if created is not None else 0.0
    scheduled = next((c for c in status.conditions or [] if c.type == "PodScheduled"), None)
    unschedulable = scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable"
    message = (scheduled.message or "") if scheduled is not None else ""
    if unschedulable and _INSUFFICIENT.search(message):
        if pending_for > pending_timeout:
            return _failed(
                JobReturnCode.INFRASTRUCTURE_ERROR,
                f"not scheduled within pending_timeout={pending_timeout:g}s: {message}",
            )
        return JobStatus(JobState.STARTING, JobReturnCode.UNKNOWN, message, done=False, waiting_for_resources=True)
    if pending_for > startup_timeout:
        why = message if unschedulable else _pending_detail(status)
        return _failed(
            JobReturnCode.INFRASTRUCTURE_ERROR,
            f"pod did not start within startup_timeout={startup_timeout:g}s" + (f": {why}" if why else ""),
        )
    return JobStatus(JobState.STARTING, JobReturnCode.UNKNOWN, "", done=False)


def _pending_detail(status: Any) -> str:
    for s in container_statuses(status):
        waiting = s.state.waiting if s.state else None
        if waiting is not None and waiting.reason:
            return waiting.reason + (f": {waiting.message}" if waiting.message else "")
    for c in status.conditions or []:
        if c.status == "False" and (c.reason or c.message):
            return ": ".join(x for x in (c.reason, c.message) if x)
    return ""


@dataclass(frozen=True)
class GroupStatus:
    """A multi-node site job's meaning (see :func:`map_pod_group`): ``pod`` is the pod that decided
    it (the failing one, or rank 0) and its status, with the reason naming that pod's node rank."""

    pod: str
    status: JobStatus


def map_pod_group(
    pods: Sequence[tuple[str, k8s.V1Pod | None]],
    *,
    now: datetime,
    pending_timeout: float,
    startup_timeout: float,
    events: Mapping[str, Sequence[Any]] | None = None,
) -> GroupStatus:
    """The state table of a group of pods that is ONE site job (``docs/state-mapping.md``).

    ``pods`` are ``(name, pod as read now or None)`` in node-rank order. Each pod goes through
    :func:`map_pod`; the group fails as soon as one pod fails, vanishes or times out (the first by
    node rank among those, its reason prefixed with ``node rank R of N (pod NAME)``), succeeds when
    every pod succeeded, waits for resources while any pod does, and runs once every pod runs or
    has finished. One pod is the same as :func:`map_pod`.
    """
    if not pods:
        raise ValueError("a site job has at least one pod")
    statuses = [
        (name, map_pod(
            pod, now=now, pending_timeout=pending_timeout, startup_timeout=startup_timeout,
            events=(events or {}).get(name, ()),
        ))
        for name, pod in pods
    ]  # fmt: skip
    if len(statuses) == 1:
        return GroupStatus(*statuses[0])
    total = len(statuses)
    for rank, (name, status) in enumerate(statuses):
        if status.done and status.state is not JobState.SUCCEEDED:
            reason = f"node rank {rank} of {total} (pod {name}): {status.reason}"
            return GroupStatus(name, replace(status, reason=reason))
    first = statuses[0][0]
    if all(status.done for _name, status in statuses):
        return GroupStatus(first, statuses[0][1])
    waiting = [(rank, name, s) for rank, (name, s) in enumerate(statuses) if s.waiting_for_resources]
    if waiting:
        rank, name, status = waiting[0]
        return GroupStatus(name, replace(status, reason=f"node rank {rank} of {total} (pod {name}): {status.reason}"))
    if all(s.state in (JobState.RUNNING, JobState.SUCCEEDED) for _name, s in statuses):
        return GroupStatus(first, JobStatus(JobState.RUNNING, JobReturnCode.UNKNOWN, "", done=False))
    return GroupStatus(first, JobStatus(JobState.STARTING, JobReturnCode.UNKNOWN, "", done=False))
