"""SLURM sites through real Airflow (``airflow dags test``) on a real single-node SLURM cluster
(munged, slurmctld, slurmd, 4 fake GPUs): every site job is a batch job submitted with sbatch and
watched through squeue/scontrol. The federated result must equal the process-sites run bitwise."""

from __future__ import annotations

import copy
import pathlib
import shutil
import sys

import pytest
import yaml

from flare_airflow_testing.harness import REPO, AirflowHome, behave_job, tiny_model
from flare_airflow_testing.slurm.cluster import SlurmCluster
from flare_airflow_testing.slurm.sshd import Sshd
from tests.e2e.test_kubernetes_sites import k8s_block

pytestmark = pytest.mark.e2e


def slurm_block(tmp_path: pathlib.Path, **extra: object) -> dict:
    return {"output_dir": str(tmp_path / "slurm-out"), "poll_interval": 0.5, "pending_timeout": 60, **extra}


def digits_job(
    airflow_home: AirflowHome, name: str, slurm_sites: list[str], block: dict, rounds: int | None = None
) -> pathlib.Path:
    job = yaml.safe_load((REPO / "dags" / "digits.yaml").read_text())
    job["job"] = name
    job["initial_model"] = str(REPO / "examples" / "digits" / "initial_model.safetensors")
    job["trainer"]["script"] = str(REPO / "examples" / "digits" / "trainer.py")
    job["trainer"]["command"] = [sys.executable]
    if rounds:
        job["rounds"] = rounds
    for site in slurm_sites:
        job["sites"][site] = {"launcher": "slurm", "launcher_spec": {"slurm": copy.deepcopy(block)}}
    return airflow_home.write_job(name.replace("-", "_"), job)


@pytest.fixture
def slurm_airflow(airflow_home: AirflowHome, slurm: SlurmCluster):
    saved = dict(airflow_home.env)
    airflow_home.env.update(slurm.env)
    yield airflow_home
    airflow_home.env.clear()
    airflow_home.env.update(saved)


def test_all_slurm_sites_match_the_process_run_bitwise(
    slurm_airflow: AirflowHome, slurm: SlurmCluster, tmp_path: pathlib.Path
) -> None:
    sites = ["site-1", "site-2", "site-3", "site-4"]
    block = slurm_block(tmp_path)
    # Two rounds keep the tier fast; the comparison is bitwise whatever the number of rounds.
    jobs = slurm_airflow.run(
        "flare_digits_slurm", digits_job(slurm_airflow, "digits-slurm", sites, block), conf={"rounds": 2}
    )
    assert jobs.returncode == 0, jobs.log[-6000:]
    assert {jobs.tasks[t] for t in ("prepare", "round_2.global_model", "publish", "sweep_slurm_jobs")} == {"success"}, (
        jobs.tasks
    )
    assert {jobs.tasks[f"round_{r}.{s}"] for r in (1, 2) for s in sites} == {"success"}
    assert {jobs.tasks[f"round_{r}.{s}"] for r in (3, 4, 5) for s in sites} == {"skipped"}
    assert jobs.metrics()["rounds"][-1]["evaluation"]["accuracy"] >= 0.85
    assert "SLURM job" in jobs.log and "fl-digits-slurm-site-3-r2-" in jobs.log
    assert "[site-3 r2] site site-3 round 2:" in jobs.log  # the job's output, in the task log
    assert slurm.jobs() == []

    local = slurm_airflow.run(
        "flare_digits_slurm_ref", digits_job(slurm_airflow, "digits-slurm-ref", [], block), conf={"rounds": 2}
    )
    assert local.returncode == 0, local.log[-4000:]
    assert jobs.state["published"]["sha256"] == local.state["published"]["sha256"]


def test_failing_and_bad_slurm_sites_local_and_through_ssh(
    airflow_home: AirflowHome, slurm: SlurmCluster, sshd: Sshd, tmp_path: pathlib.Path
) -> None:
    """site-1 (healthy) and site-3 (sends NaN) submit from the worker; site-2 (fails) through the
    login node's SSH connection (sbatch, scontrol, scancel and the output file over SSH)."""
    job = behave_job(
        airflow_home.root, "slurm-bad", sites=3, rounds=1, min_clients=1, args=["--fail", "site-2", "--nan", "site-3"]
    )
    job["trainer"]["command"] = [sys.executable]
    job["sites"]["@default"] = {"launcher": "slurm", "launcher_spec": {"slurm": slurm_block(tmp_path)}}
    job["sites"]["site-2"] = {"launcher_spec": {"slurm": slurm_block(tmp_path, connection="ssh:hpc_login")}}
    saved = dict(airflow_home.env)
    airflow_home.env.update(slurm.env)
    airflow_home.env["AIRFLOW_CONN_HPC_LOGIN"] = sshd.connection_uri_json()
    try:
        result = airflow_home.run("flare_slurm_bad", airflow_home.write_job("slurm_bad", job))
    finally:
        airflow_home.env.clear()
        airflow_home.env.update(saved)
    assert result.tasks == {
        "prepare": "success",
        "round_1.site-1": "success",
        "round_1.site-2": "failed",
        "round_1.site-3": "failed",
        "round_1.global_model": "success",
        "publish": "success",
        "verdict": "success",
        "sweep_slurm_jobs": "success",
    }, result.log[-4000:]
    assert "site site-2 round 1: SLURM job" in result.log and "submitted through ssh:hpc_login" in result.log
    rejected = result.metrics()["rounds"][0]["rejected"]
    # the exit code and the job's last output lines, in the task's error and the round's report
    assert "(FAILED (NonZeroExitCode)): the job failed: exit code 3" in rejected["site-2"]
    assert "its last output: site-2: failing on purpose" in rejected["site-2"]
    assert "EXECUTION_ERROR" in rejected["site-2"]
    assert "NaN" in rejected["site-3"]
    assert "site 'site-2' round 1 failed: SLURM job" in result.log
    assert slurm.jobs() == []


def test_mixed_process_kubernetes_and_slurm_sites(
    slurm_airflow: AirflowHome, slurm: SlurmCluster, control_plane, node_agent, namespace: str, tmp_path: pathlib.Path
) -> None:
    dag_file = digits_job(slurm_airflow, "digits-mixed3", ["site-3"], slurm_block(tmp_path))
    job = yaml.safe_load((dag_file.parent / "job.yaml").read_text())
    job["sites"]["site-2"] = {
        "launcher": "k8s",
        "launcher_spec": {"k8s": k8s_block(slurm_airflow, namespace, control_plane.kubeconfig_path())},
    }
    (dag_file.parent / "job.yaml").write_text(yaml.safe_dump(job))
    result = slurm_airflow.run("flare_digits_mixed3", dag_file, conf={"rounds": 2})
    assert result.returncode == 0, result.log[-6000:]
    assert {result.tasks[f"round_{r}.site-{s}"] for r in (1, 2) for s in (1, 2, 3, 4)} == {"success"}
    assert {result.tasks[t] for t in ("prepare", "round_1.global_model", "round_2.global_model", "publish")} == {
        "success"
    }
    assert "site site-3 round 2: SLURM job" in result.log
    assert "site site-2 round 1 pod fl-digits-mixed3-site-2-r1-" in result.log
    assert "site job digits-mixed3/site-1 round 1/2 (train)" in result.log
    assert slurm.jobs() == []
    shutil.rmtree(dag_file.parent)


FIRST_TRY_FAILS = """
import os, sys
import flare_airflow.client as flare
model = flare.receive()
if "/try-1/" in os.environ["FLARE_OUTPUT"]:
    sys.exit("first try fails on purpose")
flare.send(flare.FLModel(params={k: v + 1 for k, v in model.params.items()}, meta={"num_samples": 1}))
"""


def test_a_retry_submits_a_new_job_and_succeeds(
    slurm_airflow: AirflowHome, slurm: SlurmCluster, tmp_path: pathlib.Path
) -> None:
    script = tmp_path / "first_try_fails.py"
    script.write_text(FIRST_TRY_FAILS)
    job = {
        "job": "slurm-retry",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": str(tiny_model(tmp_path / "init.safetensors")),
        "trainer": {"script": str(script), "command": [sys.executable]},
        "evaluate": False,
        "sites": {
            "site-1": {
                "launcher": "slurm",
                "retries": 1,
                "retry_delay_seconds": 0,
                "launcher_spec": {"slurm": slurm_block(tmp_path)},
            }
        },
    }
    result = slurm_airflow.run("flare_slurm_retry", slurm_airflow.write_job("slurm_retry", job))
    assert set(result.tasks.values()) == {"success"}, result.log[-4000:]
    assert result.state["tasks"]["round_1.site-1"]["try_number"] == 2
    assert "-site-1-r1-" in result.log and "-t1) submitted" in result.log and "-t2) submitted" in result.log
    assert "first try fails on purpose" in result.log
    assert slurm.jobs() == []
