"""Container sites through real Airflow: every site task runs the trainer image under rootful podman.

The federated result must equal the process-sites run bitwise (the image's numpy is the lock's,
and the worker's OPENBLAS_* settings are passed into the container), every site task and the
run's container sweep succeed, and no container of the run is left on the engine.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import yaml

from flare_airflow_testing.containers import engine
from flare_airflow_testing.harness import REPO, AirflowHome

pytestmark = pytest.mark.e2e

SITES = ["site-1", "site-2", "site-3", "site-4"]


def digits_job(airflow_home: AirflowHome, name: str, container: dict | None) -> pathlib.Path:
    job = yaml.safe_load((REPO / "dags" / "digits.yaml").read_text())
    job["job"] = name
    job["initial_model"] = str(REPO / "examples" / "digits" / "initial_model.safetensors")
    job["trainer"]["script"] = str(REPO / "examples" / "digits" / "trainer.py")
    if container is not None:
        for site in SITES:
            job["sites"][site] = {"launcher": "container", "launcher_spec": {"container": container}}
    return airflow_home.write_job(name.replace("-", "_"), job)


def test_container_sites_match_the_process_run_bitwise(airflow_home: AirflowHome, trainer_image: str) -> None:
    block = {"image": trainer_image, "pull": "never", "trainer_script": "/opt/trainer/trainer.py"}
    boxed = airflow_home.run("flare_digits_boxed", digits_job(airflow_home, "digits-boxed", block))
    assert boxed.returncode == 0, boxed.log[-6000:]
    assert {boxed.tasks[f"round_{r}.{s}"] for r in range(1, 6) for s in SITES} == {"success"}
    assert boxed.tasks["sweep_containers"] == "success"
    # --json gives every task's dates and duration (benchmarks read rounds from them)
    for task_id, info in boxed.state["tasks"].items():
        assert info["start_date"] <= info["end_date"] and info["duration"] >= 0, (task_id, info)
    assert set(boxed.tasks.values()) == {"success"}
    assert boxed.metrics()["rounds"][-1]["evaluation"]["accuracy"] >= 0.90
    left = subprocess.run(
        [engine(), "ps", "-a", "-q", "--filter", "label=flare-airflow.job=digits-boxed"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert left.split() == [], "every site container is removed when its task ends"

    local = airflow_home.run("flare_digits_unboxed", digits_job(airflow_home, "digits-unboxed", None))
    assert local.returncode == 0, local.log[-4000:]
    assert boxed.state["published"]["sha256"] == local.state["published"]["sha256"]
