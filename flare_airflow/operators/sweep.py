"""The run's sweeps: teardowns that end the site jobs a run's tries left behind.

A backend whose jobs can outlive their task names a sweep in its binding
(:mod:`flare_airflow.operators.bindings`). A site's jobs are reached from where its tasks run -- its
container engine, its cluster credentials, its site policy -- so the builder adds one sweep per
queue and executor the backend's sites use (:func:`sweep_groups`), routed there, each ending the
jobs of its own sites only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator

from flare_airflow.core.config import JobConfig, SiteSpec, apply_site_policy
from flare_airflow.core.errors import ConfigError
from flare_airflow.operators.bindings import sites_swept_by
from flare_airflow.operators.site_steps import site_policy, site_routing


class SweepOperator(BaseOperator):
    """Base of a backend's sweep (the builder adds it as the run's teardown).

    It runs when every other task has finished, also when a round failed, and its own outcome does
    not change the run's. Best effort: what cannot be reached is logged.

    :param job: the job.
    :param sites: the sites this sweep ends jobs of (default: every site of its backend).
    """

    ui_color = "#eeeeee"
    sweep_doc = ""

    def __init__(self, *, job: JobConfig, sites: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job = job
        self.sites = list(sites) if sites is not None else None

    def swept_sites(self) -> dict[str, SiteSpec]:
        """This sweep's sites (name -> spec), as this worker's site policy makes them: on a site's
        own worker the policy, not the job, says which engine or cluster the site's jobs ran on."""
        swept = sites_swept_by(self.job.sites, type(self))
        if self.sites is not None:
            swept = {name: spec for name, spec in swept.items() if name in self.sites}
        try:
            policy = site_policy()
        except ConfigError as exc:
            self.log.warning("sweeping with the job's site specs: this worker's site policy: %s", exc)
            return swept
        if policy is None:
            return swept
        at_site: dict[str, SiteSpec] = {}
        for name, spec in swept.items():
            try:
                at_site[name] = apply_site_policy(self.job, name, policy).sites[name]
            except ConfigError as exc:
                self.log.warning("sweeping site %s with the job's spec: %s", name, exc)
                at_site[name] = spec
        return at_site


def sweep_groups(
    job: JobConfig, sweep: type[SweepOperator], task_id: str
) -> list[tuple[str, list[str], dict[str, Any]]]:
    """``(task id, sites, task arguments)`` of each sweep of backend ``sweep``: one per queue and
    executor its sites' tasks use (:func:`~flare_airflow.operators.site_steps.site_routing`). The
    default queue keeps ``task_id``; another gets it suffixed with the queue
    (``sweep_containers_hospital-b``), or with the executor when there is no queue."""
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for site in sites_swept_by(job.sites, sweep):
        groups.setdefault(tuple(sorted(site_routing(job, site).items())), []).append(site)
    made: list[tuple[str, list[str], dict[str, Any]]] = []
    taken: set[str] = set()
    for routing, sites in groups.items():
        where = dict(routing)
        suffix = where.get("queue") or where.get("executor")
        name = task_id if suffix is None else f"{task_id}_{_id_part(suffix)}"
        if name in taken:  # one queue served through two executors
            name = f"{name}_{_id_part(where.get('executor', 'default'))}"
        taken.add(name)
        made.append((name, sites, where))
    return made


def _id_part(text: str) -> str:
    return re.sub(r"[^\w.-]", "_", text)
