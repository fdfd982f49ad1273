"""``watch: sensor`` for a container site on real podman (rootful).

The launch task starts the site's container; the worker running its sensor is killed -9 while the
trainer runs; a sensor on another worker finds the container again by its identity labels,
waits in :class:`ContainerJobTrigger` (deferrable), publishes the update, and no container of the
site job is left on the engine (``podman ps -a`` filtered by its labels).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from airflow.sdk.exceptions import TaskDeferred
from safetensors.numpy import load_file

from flare_airflow.core.config import load_job
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobIdentity, JobReturnCode
from flare_airflow.core.store import ModelStore
from flare_airflow.launchers.container import ContainerLauncher
from flare_airflow.operators.site_job import SiteJobLaunchOperator
from flare_airflow.sensors.site_job import SiteJobSensor
from flare_airflow.triggers.container_state import ContainerJobTrigger
from flare_airflow_testing.harness import tiny_model
from tests.integration.containers.test_container_launcher import containers_of
from tests.integration.sensors.test_site_job_sensor_k8s import RUN_ID, Run

# The trainer (Client API, in the image): trains until the test drops ``release`` into its staging
# directory (the one host directory the container may write), then sends weights + 1.
TRAINER = (
    "import os, time\n"
    "import flare_airflow.client as flare\n"
    "model = flare.receive()\n"
    "release = os.path.join(os.path.dirname(os.environ['FLARE_OUTPUT'].removeprefix('file://')), 'release')\n"
    "print('training', flush=True)\n"
    "while not os.path.exists(release):\n"
    "    time.sleep(0.1)\n"
    "flare.send(flare.FLModel(params={k: v + 1 for k, v in model.params.items()}, meta={'num_samples': 7}))\n"
)

# A worker that runs the sensor in poke mode, as Airflow runs a task: it says when it first looked.
WORKER = """
import sys, json, types
from datetime import datetime, timezone
from flare_airflow.sensors.site_job import SiteJobSensor
job, identity = sys.argv[1], json.loads(sys.argv[2])
sensor = SiteJobSensor(task_id="site-1", job=job, site="site-1", round_num=1, identity=identity,
                       deferrable=False, poke_interval=0.5)
ti = types.SimpleNamespace(dag_id="csensor_dag", task_id="site-1", map_index=-1, try_number=1,
                           start_date=datetime.now(timezone.utc), xcom_push=lambda *a, **k: None,
                           xcom_pull=lambda *a, **k: None)
context = {"ti": ti, "task_instance": ti, "run_id": sys.argv[3], "dag": types.SimpleNamespace(dag_id="csensor_dag"),
           "params": {}}
assert sensor.poke(context) is False
print("watching", flush=True)
sensor.execute(context)
"""


def job_file(tmp_path: Path, image: str) -> tuple[Path, Path]:
    store = tmp_path / "store"
    store.mkdir()
    job = {
        "job": "csensor",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": str(tiny_model(tmp_path / "init.safetensors")),
        "store": f"file://{store}",
        "trainer": {"script": "train.py", "shutdown_timeout": 2},
        "sites": {
            "site-1": {
                "launcher": "container",
                "watch": "sensor",
                "launcher_spec": {
                    "container": {
                        "engine": "podman",
                        "image": image,
                        "pull": "never",
                        "trainer_command": ["python", "-c", TRAINER],
                        "poll_interval": 0.5,
                    }
                },
            }
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    write_artifact(
        ModelStore(store).global_model("csensor", RUN_ID, 0),
        FLModel(params={"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}),
    )
    return path, store


def first_event(trigger: ContainerJobTrigger, timeout: float) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first(), timeout))


def test_a_sensor_reattaches_after_its_worker_is_killed_and_leaves_no_container(
    trainer_image: str, tmp_path: Path
) -> None:
    path, store = job_file(tmp_path, trainer_image)
    try:
        watch_after_a_killed_worker(path, store)
    finally:  # whatever failed, nothing of this test stays on the engine
        ContainerLauncher(load_job(path).sites["site-1"].launcher_spec.container).sweep("csensor", RUN_ID)


def watch_after_a_killed_worker(path: Path, store: Path) -> None:
    launch = SiteJobLaunchOperator(task_id="site-1_launch", job=path, site="site-1", round_num=1)
    run = Run()
    identity = run.launch(launch)
    assert identity["backend"] == "container" and JobIdentity.from_dict(identity).try_number == 1
    site_job = JobIdentity.from_dict(identity).site_job()
    assert len(containers_of(site_job)) == 1

    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(path), json.dumps(identity), RUN_ID], stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None
        lines = iter(worker.stdout.readline, "")  # the sensor's log lines come first
        assert any(line.strip() == "watching" for line in lines), "the worker's sensor looked at the job"
        time.sleep(1.0)  # a few pokes of the running container
        assert worker.poll() is None, "the job still runs: the sensor still waits"
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    assert len(containers_of(site_job)) == 1, "the killed worker's sensor leaves the job running"

    # The sensor's retry on another worker, deferrable: it finds the container by its labels.
    sensor = SiteJobSensor(
        task_id="site-1", job=path, site="site-1", round_num=1, launch_task_id="site-1_launch", deferrable=True
    )
    context = run.context("site-1", try_number=2)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute(context)
    trigger = deferred.value.trigger
    assert isinstance(trigger, ContainerJobTrigger)
    classpath, kwargs = trigger.serialize()
    assert classpath == "flare_airflow.triggers.container_state.ContainerJobTrigger"
    revived = ContainerJobTrigger(**json.loads(json.dumps(kwargs)))  # as the triggerer gets it
    update_path = Path(ModelStore(store).staging("csensor", RUN_ID, 1, "site-1", 1))
    (update_path.parent / "release").touch()
    event = first_event(revived, timeout=120)
    assert event["status"] == "success", event
    assert len(containers_of(site_job)) == 1, "the trigger only looks; the sensor finishes the job"

    summary = sensor.execute_complete(context, event)
    assert summary["site"] == "site-1" and summary["num_samples"] == 7
    update = load_file(str(ModelStore(store).site_update("csensor", RUN_ID, 1, "site-1")))
    np.testing.assert_array_equal(update["w"], np.ones(4, np.float32))
    assert containers_of(site_job) == [], "nothing of the site job is left on the engine"


def test_the_trigger_says_when_the_container_is_gone_and_when_the_engine_cannot_be_asked(trainer_image: str) -> None:
    identity = JobIdentity("csensor", "run-gone", 1, "site-1", 1).to_dict()
    block = {"engine": "podman", "image": trainer_image, "pull": "never", "poll_interval": 0.01}
    gone = first_event(ContainerJobTrigger(spec=block, identity=identity), timeout=60)
    assert (gone["status"], gone["reason"]) == ("failed", "the container is gone")
    # The docker client without a daemon (these machines): every engine call fails, the trigger gives up.
    broken = first_event(ContainerJobTrigger(spec={**block, "engine": "docker"}, identity=identity), timeout=60)
    assert (broken["status"], broken["return_code"]) == ("error", int(JobReturnCode.INFRASTRUCTURE_ERROR)), broken
    assert broken["reason"].startswith("the container engine could not be asked 8 times")
