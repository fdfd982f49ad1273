"""What every flare-airflow task needs from its context: the store, the run's parameters."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow.sdk import ObjectStoragePath

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import ModelStore

HPARAM_PREFIX = "hp_"


class RunParamsError(FlareAirflowError):
    """The run's form values (DAG params) are invalid for this job."""


def default_store_uri() -> str:
    home = os.path.expanduser(os.environ.get("AIRFLOW_HOME", "~/airflow"))
    return "file://" + os.path.join(os.path.abspath(home), "flare_store")


def store_for(job: JobConfig) -> ModelStore:
    """The job's model store on Airflow's ObjectStoragePath (file:// under AIRFLOW_HOME by default)."""
    uri = job.store or default_store_uri()
    if "://" not in uri:
        uri = "file://" + str(job.resolve(uri))
    return ModelStore(ObjectStoragePath(uri))


@dataclass(frozen=True)
class RunParams:
    """The values an operator chose in the trigger form (or the job's defaults)."""

    rounds: int
    min_clients: int
    warm_start: bool
    hparams: dict[str, Any]


def run_params(context: Mapping[str, Any], job: JobConfig) -> RunParams:
    params: Mapping[str, Any] = context.get("params") or {}
    rounds = int(params.get("rounds", job.rounds))
    min_clients = int(params.get("min_clients", job.min_clients))
    if not 1 <= rounds <= job.rounds:
        raise RunParamsError(f"rounds={rounds} is outside 1..{job.rounds} (the job's configured maximum)")
    if not 1 <= min_clients <= len(job.sites):
        raise RunParamsError(f"min_clients={min_clients} is outside 1..{len(job.sites)} (the job's number of sites)")
    hparams = dict(job.trainer.hparams)
    for key in job.trainer.hparams:
        if HPARAM_PREFIX + key in params:
            hparams[key] = params[HPARAM_PREFIX + key]
    return RunParams(
        rounds=rounds,
        min_clients=min_clients,
        warm_start=bool(params.get("warm_start", job.warm_start)),
        hparams=hparams,
    )


def run_id_of(context: Mapping[str, Any]) -> str:
    return str(context["run_id"])
