"""The backend registry's core: every way a site runs its jobs, and the traits the house reads.

A backend is one package (``flare_airflow/launchers/<name>/``), one config block
(``launcher_spec.<name>``), one :class:`Backend` entry here (what it is: its names and traits,
read by the config, the site run and try-trainer) and one binding in
:mod:`flare_airflow.operators.bindings` (the Airflow classes that run it: site task, launcher
factory, sensor trigger, sweep). No other module compares backend names
(``tests/unit/test_backend_registry.py`` fails if one does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# Every backend name a job or a site policy may give as ``launcher`` (after aliases).
BackendName = Literal["process", "k8s", "slurm", "container"]


@dataclass(frozen=True)
class Backend:
    """One backend: its name, its config block and its traits (its Airflow classes are its binding).

    :param name: the ``launcher:`` value and the ``launcher_spec`` block's key.
    :param title: how messages name the backend's sites ("a Kubernetes site").
    :param aliases: other names a job may use (NVFlare's ``kubernetes``, ``docker``).
    :param watchable: a sensor in another task can find and watch its jobs (its binding has a
        launcher factory); ``False`` when the site's jobs end with the task that launched them
        (a process job never outlives its task).
    :param on_worker: the job runs as a process of this worker (working directory, host GPU
        allocation, the worker's environment).
    :param site_env: the block's ``env`` goes into the site run's environment (a pod gets it from
        its manifest instead).
    :param worker_secrets: the block's ``secret_env`` holds Airflow references resolved on the
        worker at launch (a pod's are Kubernetes Secret references, resolved by the kubelet).
    :param argv: where the trainer's argv comes from: ``host`` (this worker's interpreter and the
        job's script), ``image`` (the block's ``trainer_command`` / ``trainer_script`` in an image),
        ``cluster`` (a SLURM cluster's).
    :param needs_image: the block must name the site's trainer image.
    :param confined_by: what confines this backend's trainers, when it is not the site policy's
        ``confinement`` (bubblewrap, for trainers that run as processes of the worker); a site
        policy giving ``confinement`` to such a site is refused with this text.
    :param store_as_files: the job sees the model store only as files of the worker handed to it
        (a container's bind mounts): with an object store, only the site task that staged them can
        publish its update, so such a job cannot outlive that task (``watch: sensor`` is refused).
    """

    name: str
    title: str
    aliases: tuple[str, ...] = ()
    watchable: bool = False
    on_worker: bool = False
    site_env: bool = True
    worker_secrets: bool = True
    argv: Literal["host", "image", "cluster"] = "host"
    needs_image: bool = False
    confined_by: str | None = None
    store_as_files: bool = False

    @property
    def stages_store(self) -> bool:
        """Whether the site task hands the job an object store's files staged on its worker (a job
        that runs as a process of the worker, or sees the store only as files); the others reach
        the store themselves."""
        return self.on_worker or self.store_as_files

    def block(self, launcher_spec: Any) -> Any:
        """This backend's block of a site's ``launcher_spec``."""
        return getattr(launcher_spec, self.name)


BACKENDS: Mapping[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend(
            name="process",
            title="process",
            on_worker=True,
        ),
        Backend(
            name="k8s",
            title="Kubernetes",
            aliases=("kubernetes",),
            watchable=True,
            site_env=False,
            worker_secrets=False,
            argv="image",
            needs_image=True,
            confined_by="their pod",
        ),
        Backend(
            name="slurm",
            title="SLURM",
            watchable=True,
            argv="cluster",
            confined_by="the cluster (cgroups, the submitting user)",
        ),
        Backend(
            name="container",
            title="container",
            aliases=("docker", "podman"),
            watchable=True,
            argv="image",
            needs_image=True,
            confined_by="their container",
            store_as_files=True,
        ),
    )
}
ALIASES: Mapping[str, str] = {alias: b.name for b in BACKENDS.values() for alias in b.aliases}


def canonical(name: str) -> str:
    """The registry name of ``name`` (an alias resolved); an unknown name is returned unchanged."""
    return ALIASES.get(name, name)


def backend(name: str) -> Backend:
    """The entry of backend ``name`` (or alias); ``KeyError`` naming the known backends."""
    try:
        return BACKENDS[canonical(name)]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}") from None
