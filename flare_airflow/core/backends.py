"""The backend registry: every way a site runs its jobs, and what the rest of the house asks of it.

A backend is one package (``flare_airflow/launchers/<name>/``), one config block
(``launcher_spec.<name>``) and one :class:`Backend` entry here. The config, the DAG builder, the
launch task and sensor, try-trainer, the run's sweeps and the provider info read these entries;
no other module compares backend names (``tests/unit/test_backend_registry.py`` fails if one does).

The entries name the Airflow-side classes as dotted paths: this module is core (no Airflow
import), and a backend's heavy client (``kubernetes``) is imported only when a job has such a site
(astronomer-cosmos's mode -> operator dispatch, kept lazy).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# Every backend name a job or a site policy may give as ``launcher`` (after aliases).
BackendName = Literal["process", "k8s", "slurm", "container"]


@dataclass(frozen=True)
class Backend:
    """One backend: its name, its config block and the Airflow classes that run its site jobs.

    :param name: the ``launcher:`` value and the ``launcher_spec`` block's key.
    :param title: how messages name the backend's sites ("a Kubernetes site").
    :param aliases: other names a job may use (NVFlare's ``kubernetes``, ``docker``).
    :param site_task: the fused site task's operator class (``watch: task``).
    :param launcher: a function ``(job, site, *, try_number, sink, hidden) -> JobLauncherSpec``
        building the site's launcher on this worker, or ``None`` when the site's jobs end with the
        task that launched them (no ``watch: sensor``; a process job never outlives its task).
    :param trigger: a function ``(job, site, handle, round_num) -> trigger`` for a deferrable sensor.
    :param trigger_module: the module holding that trigger's class (the provider info lists it).
    :param sweep: ``(task_id, operator class)`` of the run's teardown ending jobs the run left
        behind, or ``None`` when the backend's jobs cannot outlive their task.
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
    site_task: str
    aliases: tuple[str, ...] = ()
    launcher: str | None = None
    trigger: str | None = None
    trigger_module: str | None = None
    sweep: tuple[str, str] | None = None
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

    @property
    def watchable(self) -> bool:
        """Whether a sensor in another task can find and watch this backend's jobs."""
        return self.launcher is not None

    def block(self, launcher_spec: Any) -> Any:
        """This backend's block of a site's ``launcher_spec``."""
        return getattr(launcher_spec, self.name)


BACKENDS: Mapping[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend(
            name="process",
            title="process",
            site_task="flare_airflow.operators.site.SiteTrainOperator",
            on_worker=True,
        ),
        Backend(
            name="k8s",
            title="Kubernetes",
            aliases=("kubernetes",),
            site_task="flare_airflow.operators.pod.SitePodOperator",
            launcher="flare_airflow.operators.pod.kubernetes_launcher",
            trigger="flare_airflow.operators.pod.pod_trigger",
            trigger_module="flare_airflow.triggers.pod_state",
            sweep=("sweep_pods", "flare_airflow.operators.run.SweepPodsOperator"),
            site_env=False,
            worker_secrets=False,
            argv="image",
            needs_image=True,
            confined_by="their pod",
        ),
        Backend(
            name="slurm",
            title="SLURM",
            site_task="flare_airflow.operators.slurm.SiteSlurmOperator",
            launcher="flare_airflow.operators.slurm.slurm_launcher",
            trigger="flare_airflow.operators.slurm.slurm_trigger",
            trigger_module="flare_airflow.triggers.slurm_state",
            sweep=("sweep_slurm_jobs", "flare_airflow.operators.slurm.SweepSlurmJobsOperator"),
            argv="cluster",
            confined_by="the cluster (cgroups, the submitting user)",
        ),
        Backend(
            name="container",
            title="container",
            aliases=("docker", "podman"),
            site_task="flare_airflow.operators.container.SiteContainerOperator",
            launcher="flare_airflow.operators.container.container_launcher",
            trigger="flare_airflow.operators.container.container_trigger",
            trigger_module="flare_airflow.triggers.container_state",
            sweep=("sweep_containers", "flare_airflow.operators.container.SweepContainersOperator"),
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


def load(dotted: str) -> Any:
    """The object a registry entry names (``package.module.attribute``), imported now."""
    module, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def sweeps(sites: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(task_id, operator class)`` of the teardowns a run over ``sites`` (name -> site spec)
    needs: one per backend that has a sweep and at least one site, in registry order."""
    used = {site.launcher for site in sites.values()}
    return [b.sweep for b in BACKENDS.values() if b.sweep is not None and b.name in used]


def sites_swept_by(sites: Mapping[str, Any], operator: type) -> dict[str, Any]:
    """The sites (name -> site spec) whose backend's sweep is ``operator``: what that teardown ends."""
    path = f"{operator.__module__}.{operator.__qualname__}"
    return {name: site for name, site in sites.items() if (b := backend(site.launcher)).sweep and b.sweep[1] == path}
