"""Helpers of the Airflow-layer unit tests: a real job on disk, a real store, and a small fake TI.

The fake task instance stands in only where Airflow's runtime is absent (no scheduler, no API
server, no database): it answers ``xcom_pull`` from a dict and has the identity attributes the
operators read. Everything else (jobs, operators, the store, FedAvg) is the real code.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flare_airflow.core.config import JobConfig, job_from_dict
from flare_airflow.core.model import FLModel, write_artifact

RUN_ID = "manual__2026-01-01T00:00:00+00:00"


def make_job(tmp_path: pathlib.Path, **overrides: Any) -> JobConfig:
    """A two-site process job whose trainer script and initial model exist under ``tmp_path``."""
    (tmp_path / "train.py").write_text("")
    write_artifact(tmp_path / "init.safetensors", FLModel(params={"w": np.zeros(3, np.float32)}))
    data: dict[str, Any] = {
        "job": "unit",
        "rounds": 2,
        "min_clients": 2,
        "initial_model": "init.safetensors",
        "trainer": {"script": "train.py"},
        "store": str(tmp_path / "store"),
        "evaluate": False,
        "sites": {"site-1": {}, "site-2": {}},
    }
    data.update(overrides)
    return job_from_dict(data, base_dir=str(tmp_path))


@dataclass
class FakeTI:
    """``xcom_pull`` answers from ``xcoms[(task_id, key)]``; the Task SDK is not running here."""

    xcoms: dict[tuple[str, str], Any] = field(default_factory=dict)
    try_number: int = 1
    dag_id: str = "flare_unit"
    run_id: str = RUN_ID

    def xcom_pull(self, task_ids: str, key: str = "return_value") -> Any:
        return self.xcoms.get((task_ids, key))


def context(ti: FakeTI | None = None, **params: Any) -> dict[str, Any]:
    """The parts of a task's context the operators read."""
    return {"ti": ti or FakeTI(), "run_id": RUN_ID, "params": params, "dag_run": None}
