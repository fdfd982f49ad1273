"""Every DAG in dags/ loads without import errors; the provider is registered with Airflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from flare_airflow_testing.harness import REPO, AirflowHome


def test_every_dag_in_dags_folder_imports() -> None:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}, bag.import_errors
    assert "flare_digits" in bag.dag_ids
    dag = bag.dags["flare_digits"]
    assert len(dag.tasks) == 3 + 5 * 5  # prepare, publish, verdict; 5 rounds of 4 sites + FedAvg
    form = dag.params.dump()
    assert form["rounds"] == 5 and form["min_clients"] == 3 and form["warm_start"] is False
    assert {"hp_lr", "hp_local_epochs", "hp_batch_size"} <= set(form)
    # The LoRA example loads without torch in Airflow's environment (its trainers use .lm-venv's Python).
    assert len(bag.dags["flare_llm_lora"].tasks) == 3 + 3 * 4


def test_the_launch_and_watch_example_composes_the_operator_and_the_sensor() -> None:
    from airflow.dag_processing.dagbag import DagBag

    from flare_airflow.operators.site_job import SiteJobLaunchOperator
    from flare_airflow.sensors.site_job import SiteJobSensor

    bag = DagBag(dag_folder=str(REPO / "dags" / "launch_and_watch_dag.py"))
    assert bag.import_errors == {}, bag.import_errors
    tasks = bag.dags["flare_digits_launch_and_watch"].task_dict
    assert isinstance(tasks["hpc-a_launch"], SiteJobLaunchOperator)
    watch = tasks["hpc-a"]
    assert isinstance(watch, SiteJobSensor) and watch.mode == "reschedule" and watch.timeout == 3600
    assert tasks["hpc-a_launch"].downstream_task_ids == {"hpc-a"}
    assert tasks["hpc-a"].downstream_task_ids == {"global_model"}


def test_provider_is_registered(airflow_home: AirflowHome) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "list", "-o", "json"],
        env={**airflow_home.env, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        check=True,
    )
    providers = {p["package_name"]: p for p in json.loads(out.stdout[out.stdout.index("[") :])}
    assert "flare-airflow" in providers


def test_validate_command_reports_errors_with_file_and_field(tmp_path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("job: x\nrounds: 0\nmin_clients: 1\n")
    cli = [os.path.join(os.path.dirname(sys.executable), "flare-airflow"), "validate"]
    out = subprocess.run([*cli, str(bad)], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert f"{bad}:2: rounds: must be greater than or equal to 1, got 0" in out.stderr  # file, line, field
    ok = subprocess.run([*cli, str(REPO / "dags" / "digits.yaml")], capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and "site site-4: launcher process" in ok.stdout


def test_run_without_a_metadata_database_says_how_to_create_it(tmp_path) -> None:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    cli = os.path.join(os.path.dirname(sys.executable), "flare-airflow")
    out = subprocess.run([cli, "run", "flare_digits"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "cannot read Airflow's metadata database" in out.stderr, out.stderr
    assert "airflow db migrate" in out.stderr
    assert not list((tmp_path / "home").glob("flare_store/*")), "nothing ran"
