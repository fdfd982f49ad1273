"""The one builder of a container site job's ``run`` command (podman and docker share it).

Security defaults no site block can loosen: a non-root user, a read-only root filesystem with a
private ``/tmp`` tmpfs, every capability dropped, ``no-new-privileges``, no network unless the
site's block says ``bridge``, a PID limit, and only two mounts of the model store: the round's
input global model (and its record), read-only, and this try's staging directory, read-write --
both at the paths the Client API's variables name, so the trainer sees what a process would.

Environment values never appear in the argv: each variable is passed as ``--env NAME`` and the
engine reads its value from its own environment (:func:`run_command` returns both).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from flare_airflow.core import envvars
from flare_airflow.core.spec import JobIdentity, SiteJob
from flare_airflow.core.store import path_from_uri
from flare_airflow.launchers.container.naming import container_name, labels
from flare_airflow.launchers.errors import LaunchError

if TYPE_CHECKING:  # pydantic config models: only their attributes are read here
    from flare_airflow.core.config import ContainerLaunchSpec, ResourceSpec

# The worker's BLAS settings go into the container unchanged, so it computes what a process
# trainer on this worker computes (INFRA.md: machines differ by CPU vendor).
PASSED_ON_PREFIXES = ("OPENBLAS_",)


def store_mounts(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(path, mode)`` of what the trainer may see of the store: the input global model and its
    record (read-only, when they exist) and the staging directory its update goes to (read-write)."""
    mounts: list[tuple[str, str]] = []
    model = env.get(envvars.FLARE_GLOBAL_MODEL)
    if model:
        path = local_path(model)
        record = path.with_name(path.name.removesuffix(".safetensors") + ".json")
        mounts += [(str(p), "ro") for p in (path, record) if p.exists()]
    mounts.append((str(staging_dir(env)), "rw"))
    return mounts


def local_path(uri: str) -> pathlib.Path:
    """The host path of a store location the site task staged locally (``/x`` or ``file:/x``)."""
    path = path_from_uri(uri)
    if not isinstance(path, pathlib.Path):
        raise LaunchError(f"{uri!r} is not a local file: a container mounts only local files of the model store")
    return path


def staging_dir(env: Mapping[str, str]) -> pathlib.Path:
    """The directory the trainer writes its update into (``FLARE_OUTPUT``'s)."""
    output = env.get(envvars.FLARE_OUTPUT)
    if not output:
        raise LaunchError("a container site job needs FLARE_OUTPUT (its staging directory) in its environment")
    return local_path(output).parent


def run_command(
    spec: ContainerLaunchSpec,
    resources: ResourceSpec | None,
    job: SiteJob,
    identity: JobIdentity,
    *,
    gpu_devices: Sequence[str] = (),
    secrets: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    cidfile: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)``: the attached ``run`` of this site job, and the engine's environment that
    holds every variable's value (the worker's own ``environ`` plus the job's and the secrets).

    Attached: the engine's ``run`` itself returns the trainer's exit code and streams its output,
    so a job needs no ``wait``, ``inspect`` or ``logs`` call of its own. ``cidfile``: where the
    engine writes the container's id once it created it (the launch knows then that the image was
    there). Signals to the ``run`` process are not passed on: only ``terminate`` (``stop``, with the
    job's shutdown timeout) ends the container."""
    if spec.image is None:
        raise LaunchError(f"{job.label}: a container site needs launcher_spec.container.image")
    environ = dict(os.environ if environ is None else environ)
    values = {k: v for k, v in environ.items() if k.startswith(PASSED_ON_PREFIXES)}
    values.update(job.env)
    values.update(secrets or {})
    argv = [spec.engine, "run", "--sig-proxy=false", "--name", container_name(identity)]
    if cidfile:
        argv += ["--cidfile", cidfile]
    for key, value in labels(identity).items():
        argv += ["--label", f"{key}={value}"]
    argv += [
        "--user",
        spec.user,
        "--read-only",
        "--tmpfs",
        f"/tmp:rw,nosuid,nodev,size={spec.tmp_size},mode=1777",  # noqa: S108 - the container's own tmpfs
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--network",
        spec.network,
        "--pids-limit",
        str(spec.pids_limit),
        "--pull",
        spec.pull,
        "--stop-timeout",
        str(max(1, int(job.shutdown_timeout))),
    ]
    if resources is not None and resources.memory:
        from flare_airflow.core.config.resources import quantity_bytes

        memory = str(int(quantity_bytes(resources.memory)))
        # No swap beyond the limit: an over-limit trainer is OOM-killed, as in a pod.
        argv += ["--memory", memory, "--memory-swap", memory]
    if resources is not None and resources.num_of_cpus:
        argv += ["--cpus", f"{resources.num_of_cpus:g}"]
    for device in gpu_devices:
        argv += ["--device", device]
    for path, mode in store_mounts(job.env):
        argv += ["--volume", f"{path}:{path}:{mode}"]
    for volume in spec.volumes:
        argv += ["--volume", f"{volume.host_path}:{volume.mount_path}:{'ro' if volume.read_only else 'rw'}"]
    if job.cwd:
        argv += ["--workdir", job.cwd]
    for name in sorted(values):
        argv += ["--env", name]
    argv += ["--", spec.image, *job.argv]
    return argv, {**environ, **values}
