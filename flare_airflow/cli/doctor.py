"""``flare-airflow doctor JOB...``: refuse a deployment whose central secrets a site task could resolve.

Airflow's Execution API serves any Variable or Connection the api-server can resolve (its own
environment, the metadata database, its secrets backend) to *every* task that asks, site tasks on
Edge workers included (docs/threat-model.md). A central-only secret -- the central DP noise secret,
the central store connection, the tracking server's connection -- is kept from site tasks in one of
two ways:

- the site guard (``flare_airflow/edge/middleware.py``, active when ``[flare] site_keys`` names the
  consortium registry) refuses every Variable and Connection to a site's task unless the registry's
  grant for that site lists it: the secret may then live where the api-server finds it, as long as
  no grant lists it;
- without a registry, the secret must live only where the central tasks run (the environment of
  the scheduler that runs them), never where the api-server finds it.

Run this with the api-server's environment and configuration; it exits 1 naming each secret a site
task could resolve, where it is found or which grant lists it, and how to move it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flare_airflow.core.config import JobConfig, load_job
from flare_airflow.core.config.privacy import CENTRAL_NOISE_SECRET_VARIABLE


@dataclass(frozen=True)
class CentralSecret:
    kind: str  # "variable" | "connection"
    name: str
    why: str

    @property
    def env_name(self) -> str:
        return f"AIRFLOW_{'VAR' if self.kind == 'variable' else 'CONN'}_{self.name.upper()}"


def central_secrets(jobs: list[JobConfig]) -> list[CentralSecret]:
    """What only the central side may resolve: the central noise secret, each job's store connection."""
    found = [CentralSecret("variable", CENTRAL_NOISE_SECRET_VARIABLE, "keys the central DP noise of every run")]
    for conn_id in sorted({job.store_conn_id for job in jobs if job.store_conn_id}):
        found.append(CentralSecret("connection", conn_id, "the central side's credential to the whole model store"))
    for conn_id in sorted({job.tracking.conn_id for job in jobs if job.tracking and job.tracking.conn_id}):
        found.append(CentralSecret("connection", conn_id, "the tracking server's credentials (written centrally)"))
    return found


def guard_verdict(secret: CentralSecret, registry_path: str) -> str | None:
    """With the site guard on: None when no site's grant lets its tasks resolve ``secret``, else
    why one does (a grant lists it, or the registry cannot be read: the guard then refuses all, but
    the deployment is broken)."""
    from pathlib import Path

    from flare_airflow.core.trust import TrustError
    from flare_airflow.core.trust.grants import Grants

    try:
        grants = Grants.from_file(Path(registry_path))
    except TrustError as exc:
        return f"the registry cannot be read ({exc})"
    granted = sorted(g.site for g in grants.sites.values() if g.may_resolve(secret.kind, secret.name))
    if granted:
        field = f"{secret.kind}s"
        return f"the registry {registry_path} grants it to site(s) {granted}; remove it from " + ", ".join(
            f"flare_sites[{site!r}].{field}" for site in granted
        )
    return None


def site_guard_installed() -> bool:
    """Whether the Airflow plugin that installs the site guard is registered in this environment."""
    from importlib.metadata import entry_points

    return any(ep.value.startswith("flare_airflow.edge.plugin") for ep in entry_points(group="airflow.plugins"))


def where_served(secret: CentralSecret, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where the api-server would find ``secret`` (so the Execution API serves it), or None."""
    if secret.env_name in environ:
        return f"the api-server's environment ({secret.env_name})"
    from airflow.configuration import ensure_secrets_loaded
    from airflow.secrets.environment_variables import EnvironmentVariablesBackend

    for backend in ensure_secrets_loaded():
        if isinstance(backend, EnvironmentVariablesBackend):
            continue
        value: Any = (
            backend.get_variable(secret.name) if secret.kind == "variable" else backend.get_connection(secret.name)
        )
        if value is not None:
            what = type(backend).__name__
            return "the metadata database" if what == "MetastoreBackend" else f"the secrets backend {what}"
    return None


def how_to_move(secret: CentralSecret, source: str) -> str:
    if source == "the metadata database":
        remove = f"`airflow {secret.kind}s delete {secret.name}`"
    else:
        remove = f"remove it from {source}"
    return (
        f"set {secret.env_name} only in the environment of the scheduler that runs the central tasks (its "
        f"LocalExecutor), not the api-server's, then {remove}"
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    from flare_airflow.operators.trust import trust_settings

    jobs = [load_job(path) for path in args.jobs]
    registry = trust_settings().registry_path
    guarded = registry is not None and site_guard_installed()
    problems = 0
    for secret in central_secrets(jobs):
        if guarded:
            assert registry is not None
            verdict = guard_verdict(secret, registry)
            if verdict is None:
                print(f"ok: {secret.kind} {secret.name!r}: the site guard refuses it to every site's task")
                continue
            problems += 1
            print(f"REFUSED: {secret.kind} {secret.name!r} ({secret.why}) could reach site tasks: {verdict}")
            continue
        source = where_served(secret)
        if source is None:
            print(f"ok: {secret.kind} {secret.name!r} is not served to tasks by the Execution API")
            continue
        problems += 1
        print(
            f"REFUSED: {secret.kind} {secret.name!r} ({secret.why}) is served to every task, site tasks included, "
            f"by the Execution API: found in {source}. Move it: {how_to_move(secret, source)}"
        )
    if problems:
        print(f"{problems} central secret(s) reachable from site tasks; see docs/threat-model.md")
        return 1
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor", help="refuse a deployment whose central secrets site tasks could resolve (run as the api-server)"
    )
    p.add_argument("jobs", nargs="*", help="job YAML files whose store connection is central")
    p.set_defaults(func=cmd_doctor)
