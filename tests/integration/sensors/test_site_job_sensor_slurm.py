"""SiteJobLaunchOperator + SiteJobSensor on SLURM sites against real daemons (munged, slurmctld,
slurmd): launch, re-launch of the same try, poke, deferred watch through SlurmJobTrigger, and a
failing job's reason and output in the sensor's failure."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys
from typing import Any

import numpy as np
import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from flare_airflow.core.config import job_from_dict
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.store import ModelStore
from flare_airflow.operators.site_job import SiteJobLaunchOperator
from flare_airflow.sensors.site_job import SiteJobSensor
from flare_airflow_testing.harness import tiny_model
from flare_airflow_testing.k8s.kube import wait_for
from flare_airflow_testing.slurm.cluster import SlurmCluster
from tests.integration.k8s.test_site_pod_operator import RUN_ID, TRAINER
from tests.integration.sensors.test_site_job_sensor_k8s import Run


@pytest.fixture
def slurm_env(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    for name, value in slurm.env.items():
        monkeypatch.setenv(name, value)  # the tasks make their own LocalCommands from the environment
    return slurm


def tasks(tmp_path: pathlib.Path, *args: str, deferrable: bool = False):
    store = tmp_path / "store"
    job = job_from_dict(
        {
            "job": "podjob",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(tiny_model(tmp_path / "init.safetensors")),
            "store": f"file://{store}",
            "trainer": {"script": str(TRAINER), "args": list(args), "command": [sys.executable]},
            "sites": {
                "site-1": {
                    "launcher": "slurm",
                    "launcher_spec": {"slurm": {"output_dir": str(tmp_path / "out"), "poll_interval": 0.3}},
                }
            },
        }
    )
    write_artifact(
        ModelStore(store).global_model("podjob", RUN_ID, 0),
        FLModel(params={"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}),
    )
    launch = SiteJobLaunchOperator(task_id="site-1_launch", job=job, site="site-1", round_num=1)
    watch = SiteJobSensor(
        task_id="site-1", job=job, site="site-1", round_num=1, launch_task_id="site-1_launch", deferrable=deferrable
    )
    return launch, watch, store


def test_launch_relaunch_and_poke_on_slurm(slurm_env: SlurmCluster, tmp_path: pathlib.Path) -> None:
    release = tmp_path / "release"
    launch, watch, store = tasks(tmp_path, "--release", str(release))
    run = Run()
    identity = run.launch(launch)
    assert identity["backend"] == "slurm" and identity["name"].endswith("-t1")
    assert launch.execute(run.context("site-1_launch")) == identity, "the same try finds its job"
    assert [line.split()[0] for line in slurm_env.jobs()] == [identity["job_id"]], "one job, not two"
    assert watch.poke(run.context("site-1")) is False
    release.touch()
    result = wait_for(lambda: watch.poke(run.context("site-1")), 60, 0.3, what="the sensor sees success")
    assert result.xcom_value["num_samples"] == 7  # type: ignore[union-attr]
    assert ModelStore(store).site_update("podjob", RUN_ID, 1, "site-1").exists()
    # A cleared sensor: slurmctld still knows the finished job; the published update is reported.
    again = watch.poke(run.context("site-1", try_number=2))
    assert again and again.xcom_value == result.xcom_value  # type: ignore[union-attr]


def test_a_deferred_sensor_on_slurm_and_a_failing_job(slurm_env: SlurmCluster, tmp_path: pathlib.Path) -> None:
    launch, watch, _ = tasks(tmp_path, "--exit", "3", deferrable=True)
    run = Run()
    # Another try than the first test's (the cluster remembers its finished job under try 1's name).
    assert run.launch(launch, try_number=5)["name"].endswith("-t5")
    context = run.context("site-1")
    with pytest.raises(TaskDeferred) as deferred:
        watch.execute(context)
    trigger = deferred.value.trigger
    assert trigger.serialize()[0] == "flare_airflow.triggers.slurm_state.SlurmJobTrigger"
    assert trigger.serialize()[1]["cancel_on_kill"] is False

    async def first_event() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("no event")

    event = asyncio.run(first_event())
    assert event["status"] == "failed"
    with pytest.raises(AirflowFailException) as failed:
        getattr(watch, deferred.value.method_name)(context, event)
    message = str(failed.value)
    assert "exit code 3" in message and "site site-1 round 1" in message, message
    assert os.environ["SLURM_CONF"]
