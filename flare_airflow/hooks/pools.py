"""Airflow pools as the GPU resource manager: one pool per site (or site + GPU class).

A pool's slots are the site's GPUs; a site task takes ``pool_slots`` = the GPUs its job asks for,
and pools count deferred tasks (``include_deferred``) so that a deferred job keeps its GPUs.

Two checks keep Airflow from waiting forever (it only logs a warning when a pool is missing or
smaller than a task's ``pool_slots``): job validation refuses a request larger than the site's
declared GPUs, and the run's ``prepare`` task checks the live pools through Airflow's REST API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import ConfigError, FlareAirflowError

API_CONN_ID = "flare_airflow_api"


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
        request = spec.resource_spec.num_of_gpus
        known = pools.get(name)
        if known is not None and known.slots != slots:
            raise ConfigError(
                f"sites {', '.join(known.sites)} and {site} share pool {name!r} but declare different "
                f"GPU counts ({known.slots} vs {slots}); one pool has one size"
            )
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


def sync_pools(job: JobConfig, *, check: bool = False) -> tuple[list[str], list[str]]:
    """Create or update the job's pools in the metadata database (idempotent).

    Returns ``(drift found before syncing, changes made)``; with ``check`` nothing is changed.
    Runs where Airflow's database is reachable: the CLI, a deployment job, CI.
    """
    from airflow.models.pool import Pool
    from airflow.utils.session import create_session

    required = required_pools(job)
    with create_session() as session:
        live: dict[str, dict[str, Any]] = {
            str(p.pool): {"slots": p.slots, "include_deferred": bool(p.include_deferred)}
            for p in session.query(Pool).filter(Pool.pool.in_(list(required)))
        }
    drift = problems(required, live)
    changes: list[str] = []
    if check:
        return drift, changes
    for name, req in sorted(required.items()):
        current = live.get(name)
        if current == {"slots": req.slots, "include_deferred": True}:
            continue
        Pool.create_or_update_pool(name, req.slots, req.description, include_deferred=True)
        changes.append(f"{'updated' if current else 'created'} pool {name!r}: {req.slots} slot(s), deferred counted")
    return drift, changes


def live_pools_from_api(names: list[str], conn_id: str = API_CONN_ID) -> dict[str, dict[str, Any]]:
    """Read pools through Airflow's REST API (tasks cannot use the ORM).

    The connection ``flare_airflow_api`` (type http) gives the API's base URL as host, and a
    login/password that ``/auth/token`` accepts.
    """
    import httpx
    from airflow.sdk import Connection
    from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

    try:
        conn = Connection.get(conn_id)
    except Exception as exc:
        raise PoolError(
            f"cannot check this job's GPU pools ({', '.join(names)}): the Airflow connection {conn_id!r} "
            "is not defined. Define it (type http, host = the API server's URL, login/password of a user "
            "who may read pools), or set check_pools: false in the job."
        ) from exc
    base = (conn.host or "").rstrip("/")
    if conn.port and base.count(":") < 2:
        base = f"{base}:{conn.port}"
    if "://" not in base:
        base = f"http://{base}"

    @retry(
        retry=retry_if_exception_type(httpx.TransportError),
        stop=stop_after_attempt(4),
        wait=wait_exponential(0.5, max=5),
        reraise=True,
    )
    def call(client: httpx.Client, method: str, path: str, **kw: Any) -> httpx.Response:
        return client.request(method, base + path, **kw)

    with httpx.Client(timeout=20) as client:
        token = call(client, "POST", "/auth/token", json={"username": conn.login, "password": conn.password})
        if token.status_code >= 400:
            raise PoolError(f"Airflow API at {base} refused the credentials of {conn_id!r} ({token.status_code})")
        headers = {"Authorization": f"Bearer {token.json()['access_token']}"}
        live: dict[str, dict[str, Any]] = {}
        for name in names:
            resp = call(client, "GET", f"/api/v2/pools/{name}", headers=headers)
            if resp.status_code == 404:
                continue
            resp.raise_for_status()
            body = resp.json()
            live[name] = {"slots": body["slots"], "include_deferred": body.get("include_deferred", False)}
    return live
