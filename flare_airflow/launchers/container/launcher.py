""":class:`ContainerLauncher`: the launcher spec on podman or docker (its handle: :mod:`.handle`).

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
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from flare_airflow.core.spec import (
    JobIdentity,
    JobLauncherSpec,
    JobReturnCode,
    LineSink,
    SiteJob,
)
from flare_airflow.launchers.container.command import run_command, staging_dir
from flare_airflow.launchers.container.engine import ENGINE_TIMEOUT, ContainerEngineError
from flare_airflow.launchers.container.handle import AttachedRun, ContainerJobHandle
from flare_airflow.launchers.container.naming import LABEL_PREFIX, container_name, run_filters, site_job_filters
from flare_airflow.launchers.container.state import launch_failure
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.gpus import GpuAllocationError, GpuAllocator, GpuLease

if TYPE_CHECKING:
    from flare_airflow.core.config import ContainerLaunchSpec, ResourceSpec

_HIDDEN = "***"
# s between looks at the cidfile while the engine creates the container: a local file check, no
# engine call; an image pull or a container creation takes hundreds of ms.
_CREATED_CHECK = 0.02


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
