"""The container backend's state table: the engine's ``inspect`` state to ``JobState`` / ``JobReturnCode``.

=======================================  ===========  =====================  ==============================
engine state (``.State``)                state        return code            reason
=======================================  ===========  =====================  ==============================
created / configured / initialized       starting     UNKNOWN
running / paused / stopping              running      UNKNOWN
exited, OOMKilled                        failed       EXECUTION_ERROR        OOMKilled: raise memory
exited 137 (SIGKILL) under a memory      failed       EXECUTION_ERROR        OOMKilled (the engine may not
limit, not after our terminate()                                            confirm it: cgroup v1, runc)
exited after our terminate()             terminated   ABORTED                terminated (exit code N)
exited N (128 < N < 160: signal N-128)   per the core exit-code table (``map_exit``)
exited with an engine ``Error``          failed       INFRASTRUCTURE_ERROR   the engine's error
removed / unknown status                 failed       INFRASTRUCTURE_ERROR   never success
``run`` exited 125-127, never started    failed       per :func:`launch_failure`
=======================================  ===========  =====================  ==============================

An image that cannot be pulled never gets a state: ``run`` fails at once (exit 125) and the
launch fails fast with INFRASTRUCTURE_ERROR (:func:`launch_failure`), as a pod's ErrImagePull does.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Mapping
from typing import Any

from flare_airflow.core.exit_codes import map_exit
from flare_airflow.core.spec import JobReturnCode, JobState, JobStatus

_STARTING = ("created", "configured", "initialized")
_RUNNING = ("running", "paused", "stopping")
_SIGKILLED = 128 + signal.SIGKILL
# What podman and docker say when the image cannot be had (registry unreachable, no such image or
# tag, denied): the launch fails fast instead of waiting.
_PULL_FAILURE_TEXT = (
    "initializing source",
    "pinging container registry",
    "manifest unknown",
    "pull access denied",
    "error pulling",
    "trying to pull",
    "image not known",
    "no such image",
    "unable to find image",
)


def _status(state: JobState, return_code: JobReturnCode, reason: str) -> JobStatus:
    return JobStatus(state, return_code, reason, done=state.finished)


def map_container(state: Mapping[str, Any] | None, *, terminated: bool, memory_limit: str | None = None) -> JobStatus:
    """Map ``inspect``'s ``.State`` (``None``: the container is gone) per the table above;
    ``memory_limit``: the container's limit (``resource_spec.memory``), if it has one."""
    if state is None:
        return _status(
            JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR, "the container disappeared (removed by someone else)"
        )
    status = str(state.get("Status", "")).lower()
    if status in _STARTING:
        return _status(JobState.STARTING, JobReturnCode.UNKNOWN, "")
    if status in _RUNNING:
        return _status(JobState.RUNNING, JobReturnCode.UNKNOWN, "")
    if status not in ("exited", "stopped"):
        return _status(JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR, f"unknown container state {status!r}")
    code = int(state.get("ExitCode") or 0)
    if state.get("OOMKilled"):
        return _status(
            JobState.FAILED,
            JobReturnCode.EXECUTION_ERROR,
            f"OOMKilled: the trainer exceeded its memory limit (exit code {code}); raise resource_spec.memory",
        )
    if memory_limit and code == _SIGKILLED and not terminated:
        # Some engines (podman with runc on cgroup v1) do not set OOMKilled: a SIGKILL nobody sent
        # to a container under a memory limit is the kernel's OOM killer.
        return _status(
            JobState.FAILED,
            JobReturnCode.EXECUTION_ERROR,
            f"OOMKilled: the trainer was killed (SIGKILL, exit code {code}) under its memory limit of "
            f"{memory_limit}; raise resource_spec.memory",
        )
    if terminated:
        return _status(JobState.TERMINATED, JobReturnCode.ABORTED, f"terminated (exit code {code})")
    error = str(state.get("Error") or "").strip()
    if error and code != 0:
        return _status(JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR, f"the engine failed: {error}")
    mapped_state, rc, reason = map_exit(code, terminated=False)
    if 128 < code < 160:
        with contextlib.suppress(ValueError):
            reason += f" ({signal.Signals(code - 128).name})"
    return _status(mapped_state, rc, reason)


def launch_failure(returncode: int, stderr: str) -> tuple[JobReturnCode, str]:
    """Why ``run`` refused to start the container: an image that cannot be pulled or is not there
    (INFRASTRUCTURE_ERROR, fail fast), anything else the engine refused (CONFIG_ERROR)."""
    detail = " ".join(stderr.split())[-600:] or f"exit code {returncode}"
    if any(text in detail.lower() for text in _PULL_FAILURE_TEXT):
        return JobReturnCode.INFRASTRUCTURE_ERROR, f"the image could not be pulled: {detail}"
    return JobReturnCode.CONFIG_ERROR, f"the container engine refused the container: {detail}"


def never_started(state: Mapping[str, Any] | None) -> bool:
    """True when the engine created the container but could not start it (``run`` exits 125-127
    then, as it does when the trainer's own exit code is one of those: this tells them apart)."""
    if state is None:
        return True
    started = str(state.get("StartedAt") or "")
    return str(state.get("Status", "")).lower() in _STARTING or started.startswith("0001-01-01") or not started
