"""``flare-airflow doctor JOB...``: refuse a deployment whose central secrets a site task could resolve.

Airflow's Execution API serves any Variable or Connection the api-server can resolve (its own
environment, the metadata database, its secrets backend) to *every* task that asks, site tasks on
Edge workers included (docs/threat-model.md). A central-only secret -- the central DP noise secret,
the central store connection -- must therefore live only where the central tasks run (the
environment of the scheduler that runs them), never where the api-server finds it. Run this
with the api-server's environment and configuration; it exits 1 naming each secret it would
serve, where it found it, and how to move it.
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
    return found


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
    jobs = [load_job(path) for path in args.jobs]
    problems = 0
    for secret in central_secrets(jobs):
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
