"""The container site task (operators/container.py): what it checks before a container is created
(the lifecycle's check_input: a container runs the trainer itself, not the site's runner)."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.store import ModelStore
from flare_airflow.operators.container import SiteContainerOperator
from flare_airflow.operators.site_steps import SiteJobFailed
from flare_airflow.site_task.build import train_run
from tests.unit.airflow_layer import RUN_ID, FakeTI, context, make_job

CONTAINER = {"launcher": "container", "launcher_spec": {"container": {"image": "trainer:unit"}}}


def _task_and_run(tmp_path: pathlib.Path, published: FLModel, in_store: FLModel) -> tuple[SiteContainerOperator, Any]:
    """Site-1's round-1 task and its run, whose producer published ``published`` while the store
    (the staged copy) holds ``in_store``."""
    job = make_job(tmp_path, sites={"site-1": CONTAINER, "site-2": {}})
    store = ModelStore.from_uri(str(tmp_path / "store"))
    signed = write_artifact(tmp_path / "published.safetensors", published)
    write_artifact(pathlib.Path(str(store.global_model(job.job, RUN_ID, 0))), in_store)
    run = train_run(
        job, "site-1", 1, store=store, run_id=RUN_ID, total_rounds=2, hparams={}, argv=["true"], try_number=1,
        global_sha256=signed.sha256, trust=None,
    )  # fmt: skip
    return SiteContainerOperator(task_id="round_1.site-1", job=job, site="site-1", round_num=1), run


def test_a_replaced_global_model_is_refused_before_the_container_is_created(tmp_path: pathlib.Path) -> None:
    """Seen on the Edge deployment: a container site started its trainer on a replaced global model
    (only the Client API inside the image refused it); the process runner's check now runs first."""
    genuine = FLModel(params={"w": np.ones(3, np.float32)})
    task, run = _task_and_run(tmp_path, genuine, FLModel(params={"w": np.full(3, -10.0, np.float32)}))
    with pytest.raises(SiteJobFailed, match=r"it was replaced.*\[INFRASTRUCTURE_ERROR\]"):
        task.check_input(context(FakeTI()), run)


def test_the_genuine_global_model_is_launched(tmp_path: pathlib.Path) -> None:
    genuine = FLModel(params={"w": np.ones(3, np.float32)})
    task, run = _task_and_run(tmp_path, genuine, genuine)
    task.check_input(context(FakeTI()), run)  # no refusal: the lifecycle goes on to the launch
