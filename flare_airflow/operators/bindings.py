"""The backend registry's Airflow side: which operators, launchers and triggers run each backend.

:mod:`flare_airflow.core.backends` holds what a backend *is* (its name, config block and traits,
read by the config and the site run); this module binds each backend to the Airflow classes that
run its site jobs -- the fused site task, the launcher factory a sensor finds jobs with, the
deferrable sensor's trigger and the run's sweep teardown. The bindings import their modules inside
one function per backend: the import contracts see every edge, and a backend's heavy client
(``kubernetes``) is imported only when a job has such a site (astronomer-cosmos's mode -> operator
dispatch, kept lazy). ``tests/unit/test_backend_registry.py`` checks that every core entry has
exactly one binding and that the traits and the bindings agree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from flare_airflow.core.backends import BACKENDS, backend
from flare_airflow.core.config import JobConfig, SiteSpec
from flare_airflow.core.spec import JobHandleSpec, JobLauncherSpec

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.triggers.base import BaseTrigger

    from flare_airflow.operators.sweep import SweepOperator


class LauncherFactory(Protocol):
    """Builds a site's launcher on this worker; its secrets' values are hidden from every line."""

    def __call__(
        self, job: JobConfig, site: str, *, try_number: int, sink: Callable[[str], None] | None, hidden: Sequence[str]
    ) -> JobLauncherSpec: ...


class TriggerFactory(Protocol):
    """Builds the deferrable sensor's trigger watching one found site job."""

    def __call__(self, job: JobConfig, site: str, handle: JobHandleSpec, round_num: int) -> BaseTrigger: ...


@dataclass(frozen=True)
class BackendBinding:
    """One backend's Airflow classes.

    :param site_task: the fused site task's operator class (``watch: task``).
    :param launcher: the site's launcher factory for ``watch: sensor``, or ``None`` when the
        backend's jobs end with the task that launched them (its core entry is not ``watchable``).
    :param trigger: the deferrable sensor's trigger factory, or ``None`` (the sensor pokes).
    :param sweep: ``(task_id, operator class)`` of the run's teardown ending jobs the run left
        behind, or ``None`` when the backend's jobs cannot outlive their task.
    """

    site_task: type[BaseOperator]
    launcher: LauncherFactory | None = None
    trigger: TriggerFactory | None = None
    sweep: tuple[str, type[SweepOperator]] | None = None


def _process() -> BackendBinding:
    from flare_airflow.operators.site import SiteTrainOperator

    return BackendBinding(site_task=SiteTrainOperator)


def _k8s() -> BackendBinding:
    from flare_airflow.operators.pod import SitePodOperator, kubernetes_launcher, pod_trigger
    from flare_airflow.operators.pod_sweep import SweepPodsOperator

    return BackendBinding(
        site_task=SitePodOperator,
        launcher=kubernetes_launcher,
        trigger=pod_trigger,
        sweep=("sweep_pods", SweepPodsOperator),
    )


def _slurm() -> BackendBinding:
    from flare_airflow.operators.slurm import SiteSlurmOperator, SweepSlurmJobsOperator, slurm_launcher, slurm_trigger

    return BackendBinding(
        site_task=SiteSlurmOperator,
        launcher=slurm_launcher,
        trigger=slurm_trigger,
        sweep=("sweep_slurm_jobs", SweepSlurmJobsOperator),
    )


def _container() -> BackendBinding:
    from flare_airflow.operators.container import (
        SiteContainerOperator,
        SweepContainersOperator,
        container_launcher,
        container_trigger,
    )

    return BackendBinding(
        site_task=SiteContainerOperator,
        launcher=container_launcher,
        trigger=container_trigger,
        sweep=("sweep_containers", SweepContainersOperator),
    )


#: Backend name (the core registry's) -> the function that binds it, importing its modules.
BINDERS: Mapping[str, Callable[[], BackendBinding]] = {
    "process": _process,
    "k8s": _k8s,
    "slurm": _slurm,
    "container": _container,
}


@functools.cache
def binding(name: str) -> BackendBinding:
    """The Airflow classes of backend ``name`` (or alias), their modules imported now."""
    return BINDERS[backend(name).name]()


def sweeps(sites: Mapping[str, SiteSpec]) -> list[tuple[str, type[SweepOperator]]]:
    """``(task_id, operator class)`` of the teardowns a run over ``sites`` (name -> site spec)
    needs: one per backend that has a sweep and at least one site, in registry order."""
    used = {backend(site.launcher).name for site in sites.values()}
    found = [binding(name).sweep for name in BACKENDS if name in used]
    return [sweep for sweep in found if sweep is not None]


def sites_swept_by(sites: Mapping[str, SiteSpec], operator: type[SweepOperator]) -> dict[str, SiteSpec]:
    """The sites (name -> site spec) whose backend's sweep is ``operator``: what that teardown ends."""
    return {name: site for name, site in sites.items() if (s := binding(site.launcher).sweep) and s[1] is operator}
