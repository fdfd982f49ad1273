"""The job's GPU pools in a live Airflow: synced through the ORM, read through the REST API.

The plan (which pools, how many slots, what counts as a problem) is pure and lives in
:mod:`flare_airflow.core.pools`; this module is the Airflow side only, beside the other hooks
though not a ``BaseHook`` (it defines no connection type; it reads the http connection
``flare_airflow_api``). ``sync_pools`` writes the metadata database where it is reachable (the
``flare-airflow pools sync`` command, a deployment job, CI); ``live_pools_from_api`` is how a task,
which may not use the ORM, reads the pools (the run's ``prepare`` task).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.pools import PoolError, problems, required_pools

API_CONN_ID = "flare_airflow_api"


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


@contextlib.contextmanager
def api_client(conn_id: str, *, what: str, error: type[Exception] = FlareAirflowError) -> Iterator[Any]:
    """``call(method, path, **kw)`` on Airflow's REST API, logged in with the http connection
    ``conn_id`` (host = the API's base URL, login/password that ``/auth/token`` accepts).
    ``what`` says in errors (of type ``error``) what the call was for."""
    import httpx
    from airflow.sdk import Connection
    from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

    try:
        conn = Connection.get(conn_id)
    except Exception as exc:
        raise error(
            f"cannot {what}: the Airflow connection {conn_id!r} is not defined. Define it (type http, host = the "
            "API server's URL, login/password of a user who may do this)"
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
    def raw(client: httpx.Client, method: str, path: str, **kw: Any) -> httpx.Response:
        return client.request(method, base + path, **kw)

    with httpx.Client(timeout=20) as client:
        token = raw(client, "POST", "/auth/token", json={"username": conn.login, "password": conn.password})
        if token.status_code >= 400:
            raise error(
                f"cannot {what}: Airflow API at {base} refused the credentials of {conn_id!r} ({token.status_code})"
            )
        headers = {"Authorization": f"Bearer {token.json()['access_token']}"}

        def call(method: str, path: str, **kw: Any) -> httpx.Response:
            return raw(client, method, path, headers=headers, **kw)

        yield call


def live_pools_from_api(names: list[str], conn_id: str = API_CONN_ID) -> dict[str, dict[str, Any]]:
    """Read pools through Airflow's REST API (tasks cannot use the ORM).

    The connection ``flare_airflow_api`` (type http) gives the API's base URL as host, and a
    login/password that ``/auth/token`` accepts; without it, set check_pools: false in the job.
    """
    live: dict[str, dict[str, Any]] = {}
    what = f"check this job's GPU pools ({', '.join(names)}) (or set check_pools: false in the job)"
    with api_client(conn_id, what=what, error=PoolError) as call:
        for name in names:
            resp = call("GET", f"/api/v2/pools/{name}")
            if resp.status_code == 404:
                continue
            resp.raise_for_status()
            body = resp.json()
            live[name] = {"slots": body["slots"], "include_deferred": body.get("include_deferred", False)}
    return live
