"""GPU pools planned from a job: which pools its sites need, and what is wrong with the live ones.

One pool per site (or site + GPU class) whose slots are the site's GPUs; a site task takes
``pool_slots`` = the GPUs its job asks for, and pools count deferred tasks (``include_deferred``) so
that a deferred job keeps its GPUs. Airflow only logs a warning when a pool is missing or smaller
than a task's ``pool_slots`` and then waits forever, so two checks come first: job validation
refuses a request larger than the site's declared GPUs, and :func:`problems` compares the plan
with the live pools (read and written by :mod:`flare_airflow.hooks.pools`). Pure: no Airflow here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import FlareAirflowError


class PoolError(FlareAirflowError):
    """A pool a job needs is missing or too small."""


@dataclass(frozen=True)
class PoolRequirement:
    name: str
    slots: int  # the site's GPUs
    largest_request: int  # the most GPUs one site job asks for
    sites: tuple[str, ...]

    @property
    def description(self) -> str:
        return f"GPUs of {', '.join(self.sites)} (flare-airflow; slots = GPUs)"


def required_pools(job: JobConfig) -> dict[str, PoolRequirement]:
    """The pools ``job`` needs, by name. Sites may share a pool (several sites on one GPU host)."""
    pools: dict[str, PoolRequirement] = {}
    for site, spec in job.sites.items():
        name = spec.pool_name(site)
        if name is None or spec.resource_manager is None:
            continue
        slots = spec.resource_manager.num_of_gpus
        request = spec.gpus_per_job
        known = pools.get(name)  # sites sharing a pool declare one GPU count (the job's validation)
        pools[name] = PoolRequirement(
            name=name,
            slots=slots,
            largest_request=max(request, known.largest_request if known else 0),
            sites=(*(known.sites if known else ()), site),
        )
    return pools


def problems(required: dict[str, PoolRequirement], live: dict[str, dict[str, Any]]) -> list[str]:
    """What is wrong with the live pools (``name -> {slots, include_deferred}``) for this job."""
    found = []
    for name, req in sorted(required.items()):
        pool = live.get(name)
        if pool is None:
            found.append(
                f"pool {name!r} (GPUs of {', '.join(req.sites)}) does not exist: Airflow would never run "
                f"these site tasks. Create it with `flare-airflow pools sync JOB.yaml`."
            )
            continue
        if int(pool["slots"]) < req.largest_request:
            found.append(
                f"pool {name!r} has {pool['slots']} slot(s) but a site job of {', '.join(req.sites)} asks for "
                f"{req.largest_request} GPU(s): Airflow would wait forever. Run `flare-airflow pools sync JOB.yaml`."
            )
        elif int(pool["slots"]) != req.slots:
            found.append(f"pool {name!r} has {pool['slots']} slot(s); the job declares {req.slots} GPU(s)")
        if not pool.get("include_deferred", False):
            found.append(f"pool {name!r} does not count deferred tasks (include_deferred is off)")
    return found


def blocking(messages: list[str]) -> list[str]:
    """The problems that would make Airflow wait forever (the others are drift)."""
    return [m for m in messages if "does not exist" in m or "wait forever" in m]
