""":class:`ContainerJobHandle`: one site job's container as the launcher spec's handle.

A handle of a launch in this process follows the engine's attached ``run`` (its exit is the
trainer's, its output the trainer's log); a handle found again by its labels reads the container
with ``wait`` / ``inspect`` / ``logs``. Once the end was seen the log and exit state are kept and the
container is removed. ``terminate`` stops (SIGTERM, then SIGKILL after the shutdown timeout) and
removes.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from flare_airflow.core.spec import JobHandleSpec, JobIdentity, JobReturnCode, JobState, JobStatus, SiteJob
from flare_airflow.launchers.container.engine import ENGINE_EXIT_CODES, ENGINE_TIMEOUT, ContainerEngineError
from flare_airflow.launchers.container.state import launch_failure, map_container, never_started

if TYPE_CHECKING:
    from flare_airflow.launchers.container.launcher import ContainerLauncher
    from flare_airflow.launchers.gpus import GpuLease


@dataclass
class AttachedRun:
    """The engine's attached ``run`` of a container this process launched: its exit is the
    trainer's, its output (stdout and stderr) the trainer's log."""

    proc: subprocess.Popen[bytes]
    output: IO[bytes]
    cidfile: Path

    def text(self) -> str:
        self.output.seek(0)
        return self.output.read().decode(errors="replace")

    def close(self) -> None:
        self.output.close()
        self.cidfile.unlink(missing_ok=True)


class ContainerJobHandle(JobHandleSpec):
    """Handle of one site job's container (``attached``: the ``run`` this process started)."""

    def __init__(
        self,
        launcher: ContainerLauncher,
        job: SiteJob,
        identity: JobIdentity,
        container_id: str,
        *,
        lease: GpuLease | None = None,
        attached: AttachedRun | None = None,
    ) -> None:
        self.launcher = launcher
        self.job = job
        self.identity = identity
        self.container_id = container_id
        self.lease = lease
        self.attached = attached
        self._status = JobStatus(JobState.STARTING, JobReturnCode.UNKNOWN, "", done=False)
        self._final: JobStatus | None = None
        self._logs: str | None = None
        self._terminated = False
        self._lock = threading.RLock()

    @property
    def status(self) -> JobStatus:
        return self._final or self._status

    def _inspect(self) -> Mapping[str, Any] | None:
        try:
            out = self.launcher.engine("inspect", "--format", "{{json .State}}", self.container_id)
        except ContainerEngineError as exc:
            if "no such" in str(exc).lower():
                return None
            raise
        loaded = json.loads(out)
        return loaded if isinstance(loaded, dict) else None

    def _memory_limit(self) -> str | None:
        resources = self.launcher.resources
        return resources.memory if resources is not None else None

    def peek(self) -> JobStatus:
        """The container's status now, through the state table, leaving it as it is: a watcher in
        another process (a sensor's trigger) only looks; whoever accepts the result finishes it."""
        return map_container(self._inspect(), terminated=self._terminated, memory_limit=self._memory_limit())

    def poll(self) -> JobReturnCode:
        with self._lock:
            if self._final is not None:
                return self._final.return_code
            if self.attached is not None:
                code = self.attached.proc.poll()
                if code is None:
                    self._status = JobStatus(JobState.RUNNING, JobReturnCode.UNKNOWN, "", done=False)
                    return JobReturnCode.UNKNOWN
                return self._attached_ended(code)
            status = self.peek()
            self._status = status
            if status.done:
                self._finish(status)
            return status.return_code

    def _attached_ended(self, code: int) -> JobReturnCode:
        """The attached ``run`` returned ``code``: 0 is the trainer's success; anything else is
        inspected once (an OOM kill, an engine error, a ``run`` that was killed itself)."""
        if code == 0:
            state: Mapping[str, Any] | None = {"Status": "exited", "ExitCode": 0}
        else:
            state = self._inspect()
            if state is not None and not map_container(state, terminated=self._terminated).done:
                # ``run`` itself ended (killed) while the container runs on: watch it through the engine.
                self._drop_attached()
                self._status = map_container(state, terminated=self._terminated)
                return self._status.return_code
        if code in ENGINE_EXIT_CODES and never_started(state):
            rc, reason = launch_failure(code, self.launcher.mask(self.attached.text() if self.attached else ""))
            status = JobStatus(JobState.FAILED, rc, reason, done=True)
        else:
            status = map_container(state, terminated=self._terminated, memory_limit=self._memory_limit())
        self._status = status
        self._finish(status)
        return status.return_code

    def _drop_attached(self) -> None:
        if self.attached is not None:
            self.attached.close()
            self.attached = None

    def _finish(self, status: JobStatus) -> None:
        """The job ended: keep its log and state, remove the container, free its GPUs."""
        self._final = status
        self._logs = self._read_logs()
        self._drop_attached()
        if self.launcher.sink is not None:
            prefix = f"[{self.identity.site} r{self.identity.round}] "
            for line in self._logs.splitlines():
                self.launcher.sink(prefix + line)
        with contextlib.suppress(ContainerEngineError):
            self.launcher.engine("rm", "--force", self.container_id)
        if self.lease is not None:
            self.lease.release()

    def _read_logs(self) -> str:
        if self.attached is not None:
            return self.launcher.mask(self.attached.text())
        try:
            return self.launcher.mask(self.launcher.engine("logs", self.container_id))
        except ContainerEngineError as exc:
            return f"(the container's log could not be read: {exc})"

    def wait(self, timeout: float | None = None) -> JobReturnCode:
        """Block until the container exits (or ``timeout`` passes: ``UNKNOWN``), then read its final
        state: on the attached ``run``, or in the engine's own ``wait``."""
        if self._final is None:
            if self.attached is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.attached.proc.wait(timeout)
            else:
                with contextlib.suppress(ContainerEngineError):
                    self.launcher.engine("wait", self.container_id, timeout=timeout)
        return self.poll()

    def terminate(self) -> None:
        with self._lock:
            if self._final is not None:
                return
            self._terminated = True
            timeout = self.job.shutdown_timeout
            with contextlib.suppress(ContainerEngineError):
                self.launcher.engine(
                    "stop", "--time", str(max(0, int(timeout))), self.container_id, timeout=timeout + 60
                )
            if self.attached is not None:
                # The stopped container's ``run`` returns at once; its output is then complete.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.attached.proc.wait(ENGINE_TIMEOUT)
            self._logs = self._read_logs()
            if self.attached is not None and self.attached.proc.poll() is None:
                self.attached.proc.kill()
                self.attached.proc.wait()
            self._drop_attached()
            with contextlib.suppress(ContainerEngineError):
                self.launcher.engine("rm", "--force", self.container_id)
            self._final = JobStatus(JobState.TERMINATED, JobReturnCode.ABORTED, "terminated", done=True)
            if self.lease is not None:
                self.lease.release()

    @property
    def state(self) -> JobState:
        self.poll()
        return self.status.state

    @property
    def reason(self) -> str:
        status = self.status
        return status.reason if status.done else ""

    def logs(self) -> str:
        if self._logs is not None:
            return self._logs
        return self._read_logs()

    def where(self) -> dict[str, Any]:
        return {"backend": "container", "engine": self.launcher.spec.engine, "container": self.container_id[:12]}
