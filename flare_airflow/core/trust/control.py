"""The control-plane rules: what a site's worker may ask of the Edge worker API, and which
Variables and Connections a site task may resolve through the Execution API.

Pure functions over a request's parts; ``flare_airflow/edge/middleware.py`` feeds them from the
API server (the token's proven claims, the body edge3 would read, the job's worker from the
database). Each refusal says what was refused and why, for the worker's log and the audit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote

from flare_airflow.core.trust.errors import TrustError
from flare_airflow.core.trust.grants import Grants
from flare_airflow.core.trust.tokens import SITE_CLAIM

# (dag_id, task_id, run_id, try_number, map_index) -> the worker that took the job, or None.
JobOwner = Callable[[tuple[str, str, str, int, int]], str | None]


class Refused(TrustError):
    """A site's request the control plane refuses."""


def _own_worker(claims: Mapping[str, Any], grants: Grants, name: str) -> str:
    """The site of ``claims`` if the worker ``name`` is its own and the one the token names."""
    site = str(claims[SITE_CLAIM])
    grant = grants.grant(site)
    if grant is None:
        raise Refused(f"site {site!r} has no grant in {grants.where}: enrol it")
    if name not in grant.workers or claims.get("sub") != name:
        owner = grants.site_of_worker(name)
        whose = f"site {owner!r}'s worker" if owner and owner != site else "not a worker of this site"
        raise Refused(
            f"site {site!r} (token for worker {claims.get('sub')!r}) may not act as worker {name!r}: {whose}; "
            f"its workers are {list(grant.workers)}"
        )
    return site


def _own_queues(site: str, grants: Grants, queues: Any, what: str) -> None:
    grant = grants.grant(site)
    assert grant is not None  # _own_worker checked it
    if not isinstance(queues, list) or not queues:
        raise Refused(
            f"site {site!r} must name its queues to {what} (an empty or missing list means every queue): "
            f"{list(grant.queues)}"
        )
    foreign = sorted({str(q) for q in queues} - set(grant.queues))
    if foreign:
        raise Refused(f"site {site!r} may not {what} queue(s) {foreign}: its queues are {list(grant.queues)}")


def check_worker_call(
    verb: str,
    method: str,
    body: Mapping[str, Any] | None,
    claims: Mapping[str, Any],
    grants: Grants,
    job_owner: JobOwner,
) -> None:
    """Refuse (:class:`Refused`) a worker API call (``verb``; ``method``: the path after
    ``/edge_worker/v1/``) the site whose proven ``claims`` these are may not make."""
    parts = [unquote(p) for p in method.split("/")]
    body = body or {}
    if unquote(str(claims.get("method"))) != unquote(method):
        # edge3 checks this only for its shared-secret tokens: a token is for the one call it was made for.
        raise Refused(f"a token signed for {claims.get('method')!r} was used for {method!r}")
    if parts == ["health"]:
        return
    if parts[0] == "worker" and len(parts) == 2 and verb in ("POST", "PATCH"):
        site = _own_worker(claims, grants, parts[1])
        _own_queues(site, grants, body.get("queues"), "register or heartbeat for")
        return
    if parts[:2] == ["worker", "queues"] and len(parts) == 3 and verb == "PATCH":
        site = _own_worker(claims, grants, parts[2])
        if body.get("new_queues"):
            _own_queues(site, grants, body.get("new_queues"), "add")
        return
    if parts[:2] == ["jobs", "fetch"] and len(parts) == 3 and verb == "POST":
        site = _own_worker(claims, grants, parts[2])
        _own_queues(site, grants, body.get("queues"), "fetch jobs of")
        return
    job_paths = {"jobs/state": 8, "logs/push": 7, "logs/logfile_path": 7}
    if len(parts) == job_paths.get("/".join(parts[:2]), -1):
        dag_id, task_id, run_id, try_number, map_index = parts[2:7]
        try:
            key = (dag_id, task_id, run_id, int(try_number), int(map_index))
        except ValueError:
            raise Refused(f"{method}: try_number and map_index must be integers") from None
        worker = str(claims.get("sub"))
        owner = job_owner(key)
        if owner != worker:
            took = f"worker {owner!r} took it" if owner else "no worker took it"
            raise Refused(
                f"worker {worker!r} of site {claims[SITE_CLAIM]!r} may not {parts[0]}/{parts[1]} for job "
                f"{dag_id}.{task_id} run {run_id} try {try_number} map {map_index}: {took}"
            )
        return
    raise Refused(f"{verb} /edge_worker/v1/{method} is not a call a site's worker makes")


def check_secret_request(kind: str, name: str, site: str | None, grants: Grants) -> None:
    """Refuse a task of ``site`` (None: a central task) resolving the ``kind`` ("variable" or
    "connection") ``name`` through the Execution API, unless its grant lists it. Site secrets
    resolve from the worker's own environment first; this is what stops the central fallback."""
    if site is None:
        return
    grant = grants.grant(site)
    if grant is None or not grant.may_resolve(kind, name):
        raise Refused(
            f"a task of site {site!r} may not resolve the central {kind} {name!r}: site tasks resolve secrets on "
            f"their own worker (AIRFLOW_{'VAR' if kind == 'variable' else 'CONN'}_{name.upper()} there); "
            f"to share a non-secret {kind}, list it in {grants.where} flare_sites[{site!r}].{kind}s"
        )
