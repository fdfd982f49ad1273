"""Site job task for container sites: the site job is one container of the site's trainer image.

:class:`SiteContainerOperator` is the site-task lifecycle (:mod:`flare_airflow.operators.lifecycle`)
with the container launcher (:mod:`flare_airflow.launchers.container`) filling launch and watch:
the engine's own ``wait`` in the worker, ``stop`` + ``rm`` when the task is killed or times out, the
containers of earlier tries found by their labels and ended before a new one starts.
:class:`SweepContainersOperator` is the run's teardown for what a killed worker's last try left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from flare_airflow.core.config import JobConfig
from flare_airflow.core.spec import JobHandleSpec
from flare_airflow.launchers.container import ContainerEngineError, ContainerJobHandle, ContainerLauncher
from flare_airflow.operators.common import run_id_of
from flare_airflow.operators.lifecycle import SiteTaskLifecycle
from flare_airflow.operators.site_steps import site_argv
from flare_airflow.operators.sweep import SweepOperator
from flare_airflow.triggers.container_state import ContainerJobTrigger


def container_launcher(
    job: JobConfig, site: str, *, try_number: int, sink: Callable[[str], None] | None, hidden: Sequence[str]
) -> ContainerLauncher:
    """A container site's launcher: the site's engine on this worker."""
    spec = job.sites[site]
    return ContainerLauncher(
        spec.launcher_spec.container,
        spec.resource_spec,
        try_number=try_number,
        sink=sink,
        hidden=hidden,
        shutdown_timeout=job.trainer.shutdown_timeout,  # what this try's own terminate gives its container
    )


def container_trigger(job: JobConfig, site: str, handle: JobHandleSpec, round_num: int) -> ContainerJobTrigger:
    """A container site job's deferrable watch for the sensor: found again by its identity labels."""
    if not isinstance(handle, ContainerJobHandle):
        raise TypeError(f"site {site!r}: a container trigger watches a container, not {type(handle).__name__}")
    spec = job.sites[site]
    return ContainerJobTrigger.for_site(spec.launcher_spec.container, spec.resource_spec, handle.identity)


class SiteContainerOperator(SiteTaskLifecycle[ContainerJobHandle], BaseOperator):
    """Train one site for one round in a container (podman or docker) on the site's worker.

    Its arguments are the lifecycle's (:class:`~flare_airflow.operators.lifecycle.SiteTaskLifecycle`).

    Returns (XCom) the update's URI, sha256, sample count and metrics; never weights.
    """

    ui_color = "#cfe3f0"
    # The Rendered Templates tab: which site job this is and what it runs; the job's environment
    # (secrets resolved per try) is never a template field.
    template_fields: Sequence[str] = (*SiteTaskLifecycle.site_template_fields, "engine", "image")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        block = self.job.sites[self.site].launcher_spec.container
        self.engine = block.engine
        self.image = block.image

    def argv(self) -> list[str]:
        return site_argv(self.job, self.site)


class SweepContainersOperator(SweepOperator):
    """Remove every container of this run still on the worker's engine (the run's teardown).

    Such a container belongs to a try that can no longer end it (a worker killed during its last
    try). Best effort: an engine that cannot be reached is logged and the run's result stands.
    The builder runs one per queue the container sites use: on a site's own worker, its engine.
    """

    sweep_doc = "Remove containers this run left behind."

    def execute(self, context: Context) -> list[str]:
        run_id = run_id_of(context)
        removed: list[str] = []
        swept = self.swept_sites()
        engines = {spec.launcher_spec.container.engine: spec for spec in swept.values()}
        for engine, spec in sorted(engines.items()):
            try:
                removed += ContainerLauncher(spec.launcher_spec.container).sweep(self.job.job, run_id)
            except ContainerEngineError as exc:
                self.log.warning("could not sweep the containers of this run with %s: %s", engine, exc)
        if removed:
            self.log.warning("removed containers this run left behind: %s", ", ".join(removed))
        return removed
