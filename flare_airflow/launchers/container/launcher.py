""":class:`ContainerLauncher` / :class:`ContainerJobHandle`: the launcher spec on podman or docker.

Every engine call is an argv list (never a shell string) with a timeout. A launch runs the
engine's ``run`` attached, in the background: its exit is the trainer's exit code and its output
the trainer's log, so a successful job costs two engine calls (``run``, ``rm``); only a job that
failed is inspected once, to tell an OOM kill or an engine error from a plain exit code
(:func:`~flare_airflow.launchers.container.state.map_container`). A handle found again by its labels
(another process launched it) reads the container with ``wait`` / ``inspect`` / ``logs``. Once the
end was seen the log and exit state are kept and the container is removed, so nothing of a site job
stays on the host. ``terminate`` stops (SIGTERM,
then SIGKILL after the shutdown timeout) and removes. A launch whose worker died leaves its
container running: the next try finds it by its labels (:meth:`ContainerLauncher.terminate_earlier_tries`),
a sensor by :meth:`ContainerLauncher.find_job`, the run's teardown by :meth:`ContainerLauncher.sweep`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from flare_airflow.core.spec import (
    JobHandleSpec,
    JobIdentity,
    JobLauncherSpec,
    JobReturnCode,
    JobState,
    JobStatus,
    LineSink,
    SiteJob,
)
from flare_airflow.launchers.container.command import run_command, staging_dir
from flare_airflow.launchers.container.naming import LABEL_PREFIX, container_name, run_filters, site_job_filters
from flare_airflow.launchers.container.state import launch_failure, map_container, never_started
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.gpus import GpuAllocationError, GpuAllocator, GpuLease

if TYPE_CHECKING:
    from flare_airflow.core.config import ContainerLaunchSpec, ResourceSpec

ENGINE_TIMEOUT = 120.0  # s: one engine call (a pull of a large image is bounded by the launch timeout)
_HIDDEN = "***"
# s between looks at the cidfile while the engine creates the container: a local file check, no
# engine call; an image pull or a container creation takes hundreds of ms.
_CREATED_CHECK = 0.02
# What ``run`` exits with when the engine, not the trainer, failed (docker and podman agree).
_ENGINE_EXIT_CODES = (125, 126, 127)


class ContainerEngineError(RuntimeError):
    """An engine call failed (not found, timed out, refused): the engine's own words."""


class ContainerLauncher(JobLauncherSpec):
    """Launch site jobs as containers of the site's trainer image.

    :param spec: the site's ``launcher_spec.container`` block.
    :param resources: the site job's ``resource_spec`` (memory, CPUs, GPUs).
    :param try_number: the Airflow try that launches (part of the container's identity labels).
    :param sink: receives the trainer's output lines once the job ended.
    :param hidden: values (resolved secrets) replaced by ``***`` in every line and log read.
    :param environ: the environment the engine runs with (default: this process's).
    :param shutdown_timeout: seconds between SIGTERM and SIGKILL when this launcher ends a job it did
        not launch (an earlier try's, one found by its identity): the job's ``trainer.shutdown_timeout``,
        the grace its own ``terminate`` gives.
    """

    def __init__(
        self,
        spec: ContainerLaunchSpec,
        resources: ResourceSpec | None = None,
        *,
        try_number: int = 1,
        sink: LineSink | None = None,
        hidden: Iterable[str] = (),
        environ: Mapping[str, str] | None = None,
        shutdown_timeout: float = 10.0,
    ) -> None:
        self.spec = spec
        self.shutdown_timeout = shutdown_timeout
        self.resources = resources
        self.try_number = try_number
        self.sink = sink
        self.hidden = [h for h in hidden if h]
        self.environ = dict(os.environ if environ is None else environ)

    # ------------------------------------------------------------------ engine calls

    def engine(self, *args: str, env: Mapping[str, str] | None = None, timeout: float | None = ENGINE_TIMEOUT) -> str:
        """Run ``<engine> ARGS`` and return its stdout (``timeout`` ``None``: as long as it takes);
        :class:`ContainerEngineError` when it fails."""
        program = shutil.which(self.spec.engine, path=self.environ.get("PATH"))
        if program is None:
            raise ContainerEngineError(
                f"the container engine {self.spec.engine!r} is not installed on this worker (not on PATH); "
                "install podman or docker, or set launcher_spec.container.engine"
            )
        try:
            proc = subprocess.run(
                [program, *args],
                env=dict(env or self.environ),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ContainerEngineError(f"{self.spec.engine} {args[0]} did not answer within {timeout}s") from None
        if proc.returncode != 0:
            raise ContainerEngineError(self.mask(proc.stderr.strip() or f"exit code {proc.returncode}"))
        return proc.stdout

    def mask(self, text: str) -> str:
        for value in self.hidden:
            text = text.replace(value, _HIDDEN)
        return text

    def _containers(self, filters: Sequence[str]) -> list[dict[str, Any]]:
        args = ["ps", "--all", "--no-trunc", "--format", "json"]
        for value in filters:
            args += ["--filter", value]
        out = self.engine(*args).strip()
        if not out:
            return []
        if out.startswith("["):  # podman: one JSON array
            return list(json.loads(out))
        return [json.loads(line) for line in out.splitlines() if line.strip()]  # docker: one object a line

    def remove(self, containers: Sequence[str], *, stop_timeout: float) -> None:
        """Stop (SIGTERM, SIGKILL after ``stop_timeout``) and remove ``containers``."""
        if not containers:
            return
        with contextlib.suppress(ContainerEngineError):  # already stopped: rm says what is left
            self.engine("stop", "--time", str(max(0, int(stop_timeout))), *containers, timeout=stop_timeout + 60)
        self.engine("rm", "--force", *containers)

    # ------------------------------------------------------------------ the launcher spec

    def launch_job(self, job_meta: SiteJob, fl_ctx: Mapping[str, Any] | None = None) -> ContainerJobHandle:
        """Start the site job's container and return once the engine created it; ``fl_ctx``:
        ``try_number``, ``secrets`` (name -> value: in the container's environment, never in the argv)."""
        ctx = dict(fl_ctx or {})
        identity = JobIdentity.of(job_meta, int(ctx.get("try_number") or self.try_number))
        secrets = dict(ctx.get("secrets") or {})
        self.hidden += [v for v in secrets.values() if v]
        lease = self._gpus(job_meta)
        output: IO[bytes] | None = None
        try:
            self._writable_staging(job_meta)
            # podman's conmon, started by ``run``, writes an ``oom`` file into its working directory
            # when the container is OOM-killed (runc, cgroup v1): the worker's temporary directory
            # takes it (and the cidfile), never the worker's own working directory.
            workdir = Path(tempfile.gettempdir())
            cidfile = workdir / f"flare-{container_name(identity)}.cid"
            cidfile.unlink(missing_ok=True)  # the engine refuses to overwrite one
            argv, env = run_command(
                self.spec,
                self.resources,
                job_meta,
                identity,
                gpu_devices=[self.spec.gpu_devices[i] for i in lease.devices] if lease else (),
                secrets=secrets,
                environ=self.environ,
                cidfile=str(cidfile),
            )
            program = shutil.which(argv[0], path=self.environ.get("PATH"))
            if program is None:
                raise LaunchError(
                    f"{identity.label}: the container engine {argv[0]!r} is not installed on this worker; "
                    "install podman or docker, or set launcher_spec.container.engine"
                )
            output = tempfile.TemporaryFile()  # noqa: SIM115 - the handle owns it until the job ended
            proc = subprocess.Popen(
                [program, *argv[1:]],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
            container_id = self._created(proc, cidfile, identity, output, job_meta.launch_timeout or ENGINE_TIMEOUT)
        except BaseException:
            if output is not None:
                output.close()
            if lease is not None:
                lease.release()
            raise
        return ContainerJobHandle(
            self, job_meta, identity, container_id, lease=lease, attached=AttachedRun(proc, output, cidfile)
        )

    def _created(
        self, proc: subprocess.Popen[bytes], cidfile: Path, identity: JobIdentity, output: IO[bytes], timeout: float
    ) -> str:
        """The container's id once the engine wrote it; :class:`LaunchError` when ``run`` ended
        without creating a container (the image could not be had, the engine refused) or took longer
        than ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(FileNotFoundError):
                container_id = cidfile.read_text().strip()
                if container_id:
                    return container_id
            code = proc.poll()
            if code is not None and not (cidfile.exists() and cidfile.read_text().strip()):
                cidfile.unlink(missing_ok=True)
                self._remove_quietly(identity)  # a container created but not started
                output.seek(0)
                rc, reason = launch_failure(code, self.mask(output.read().decode(errors="replace")))
                raise LaunchError(f"{identity.label}: {reason}", rc)
            if code is None and time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                cidfile.unlink(missing_ok=True)
                self._remove_quietly(identity)
                raise LaunchError(
                    f"{identity.label}: the container did not start within {timeout:g}s (launch_timeout)",
                    JobReturnCode.INFRASTRUCTURE_ERROR,
                )
            time.sleep(_CREATED_CHECK)

    def _gpus(self, job: SiteJob) -> GpuLease | None:
        wanted = self.resources.num_of_gpus if self.resources is not None else 0
        if not wanted:
            return None
        allocator = GpuAllocator(num_gpus=len(self.spec.gpu_devices))
        try:
            return allocator.acquire(wanted, self.resources.mem_per_gpu_in_GiB if self.resources else None, 600.0)
        except GpuAllocationError as exc:
            raise LaunchError(f"{job.label}: {exc}") from None

    def _writable_staging(self, job: SiteJob) -> None:
        """The staging directory belongs to the container's user (the worker creates it as itself)."""
        if os.geteuid() != 0:
            return
        uid, _, gid = self.spec.user.partition(":")
        staging = staging_dir(job.env)
        staging.mkdir(parents=True, exist_ok=True)
        os.chown(staging, int(uid), int(gid or uid))

    def _remove_quietly(self, identity: JobIdentity) -> None:
        with contextlib.suppress(ContainerEngineError):
            found = self._containers(site_job_filters(identity, with_try=True))
            self.remove([str(c["Id"]) for c in found], stop_timeout=self.shutdown_timeout)

    def find_job(self, identity: JobIdentity) -> ContainerJobHandle | None:
        """The container launched under ``identity`` (by any process on this host), or ``None``."""
        found = self._containers(site_job_filters(identity, with_try=True))
        if not found:
            return None
        return ContainerJobHandle(self, identity.site_job(self.shutdown_timeout), identity, str(found[0]["Id"]))

    def terminate_earlier_tries(self, identity: JobIdentity) -> list[str]:
        """Stop (with the shutdown timeout) and remove the containers of this site job's earlier
        tries; returns their names."""
        earlier = [
            c
            for c in self._containers(site_job_filters(identity, with_try=False))
            if int((c.get("Labels") or {}).get(LABEL_PREFIX + "try", 0)) < identity.try_number
        ]
        self.remove([str(c["Id"]) for c in earlier], stop_timeout=self.shutdown_timeout)
        return [_name(c) for c in earlier]

    def sweep(self, job: str, run_id: str) -> list[str]:
        """Remove every container of one run still on this host (the run's teardown); their names."""
        found = self._containers(run_filters(job, run_id))
        self.remove([str(c["Id"]) for c in found], stop_timeout=0)
        return [_name(c) for c in found]


def _name(container: Mapping[str, Any]) -> str:
    names = container.get("Names") or []
    return str(names[0] if isinstance(names, list) and names else names or container.get("Id", "?"))


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
        if code in _ENGINE_EXIT_CODES and never_started(state):
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
