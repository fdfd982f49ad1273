"""SLURM site tasks on Airflow's real scheduler, LocalExecutor worker and triggerer (PostgreSQL),
against the real SLURM daemons: the task defers while its batch job queues and runs, the job's
output reaches the task log from the triggerer, and a task marked failed while deferred has its
job cancelled (the trigger's on_kill)."""

from __future__ import annotations

import pathlib
import sys
import textwrap
import time

import pytest
import yaml

from flare_airflow_testing.harness import tiny_model
from flare_airflow_testing.slurm.cluster import SlurmCluster
from flare_airflow_testing.stack import AirflowStack, Postgres, scheduler_stack

SECRET = "s3cr3t-Token-4711"
TRAINER = """
import os, sys, time
import flare_airflow.client as flare
model = flare.receive()
site = flare.get_site_name()
print(f"{site} training on {os.environ.get('SLURM_JOB_ID')}", flush=True)
print(f"{site} token {os.environ.get('SITE_TOKEN')}", flush=True)
if site == "site-2":
    time.sleep(600)
time.sleep(2)
print(f"{site} sending", flush=True)
flare.send(flare.FLModel(params={k: v + 1 for k, v in model.params.items()}, meta={"num_samples": 1}))
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, slurm_cluster: SlurmCluster, postgres: Postgres):
    env = {"AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True", **slurm_cluster.env, "AIRFLOW_VAR_SITE_TOKEN": SECRET}
    with scheduler_stack(tmp_path_factory.mktemp("slurm-stack"), env, postgres=postgres, triggerer=True) as airflow:
        yield airflow


def task_log(stack: AirflowStack, dag_id: str, run_id: str, task_id: str) -> str:
    logs = list((stack.home / "logs").glob(f"dag_id={dag_id}/run_id={run_id}/task_id={task_id}/attempt=1.log"))
    return "\n".join(p.read_text(errors="replace") for p in logs)


def trigger_log(stack: AirflowStack, dag_id: str, run_id: str, task_id: str) -> str:
    logs = (stack.home / "logs").glob(f"dag_id={dag_id}/run_id={run_id}/task_id={task_id}/attempt=1.log.trigger.*")
    return "\n".join(p.read_text(errors="replace") for p in logs)


def test_deferred_slurm_task_streams_output_and_mark_failed_cancels_the_job(
    stack: AirflowStack, slurm: SlurmCluster, tmp_path: pathlib.Path
) -> None:
    folder = stack.dags / "slurm_sched"
    folder.mkdir()
    (folder / "trainer.py").write_text(TRAINER)
    block = {"output_dir": str(tmp_path / "out"), "poll_interval": 0.5}
    job = {
        "job": "slurm-sched",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": str(tiny_model(folder / "init.safetensors")),
        "trainer": {"script": str(folder / "trainer.py"), "command": [sys.executable], "shutdown_timeout": 2},
        "evaluate": False,
        "sites": {
            "@default": {"retries": 0, "launcher": "slurm", "launcher_spec": {"slurm": block}},
            "site-1": {"launcher_spec": {"slurm": {**block, "secret_env": {"SITE_TOKEN": {"variable": "site_token"}}}}},
            "site-2": {},
        },
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    (folder / "dag.py").write_text(
        textwrap.dedent(
            """
            from pathlib import Path
            from flare_airflow.builder import build_dag
            dag = build_dag(Path(__file__).with_name("job.yaml"))
            """
        )
    )
    dag_id = "flare_slurm_sched"
    run_id = stack.trigger(dag_id)
    # site-2's job runs for 10 minutes unless cancelled: wait until it runs, then mark its task failed.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        running = [line for line in slurm.jobs() if "-site-2-" in line and line.endswith("RUNNING")]
        state = stack.task_instances(dag_id, run_id).get("round_1.site-2", {}).get("state")
        started = "starting" in trigger_log(stack, dag_id, run_id, "round_1.site-2")
        if running and state == "deferred" and started:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"site-2 never ran deferred: {slurm.jobs()} {stack.task_instances(dag_id, run_id)}")
    stack.api("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/round_1.site-2", json={"new_state": "failed"})
    marked = time.monotonic()
    while any("-site-2-" in line for line in slurm.jobs()) and time.monotonic() - marked < 40:
        time.sleep(0.5)
    cancelled_after = time.monotonic() - marked
    assert not any("-site-2-" in line for line in slurm.jobs()), "the job of a task marked failed is cancelled"
    state = stack.wait_for_run(dag_id, run_id, timeout=180)
    states = {t: ti["state"] for t, ti in stack.task_instances(dag_id, run_id).items()}
    triggerer_log = (stack.root / "triggerer.log").read_text(errors="replace")
    assert states == {
        "prepare": "success",
        "round_1.site-1": "success",
        "round_1.site-2": "failed",
        "round_1.global_model": "success",
        "publish": "success",
        "verdict": "success",
        "sweep_slurm_jobs": "success",
    }, (states, triggerer_log[-3000:])
    assert state == "success"
    print(f"\nsite-2's job cancelled {cancelled_after:.1f} s after its task was marked failed")
    log = task_log(stack, dag_id, run_id, "round_1.site-1")
    assert "SLURM job" in log and "submitted" in log
    # The job's output lines, written from the triggerer into the task's log while it ran.
    trigger = trigger_log(stack, dag_id, run_id, "round_1.site-1")
    assert "[site-1 r1] site-1 training on" in trigger, trigger[-3000:]
    assert "[site-1 r1] site-1 sending" in trigger
    # The trainer printed its secret: the triggerer resolved the reference again and masked it.
    assert "[site-1 r1] site-1 token ***" in trigger
    assert SECRET not in trigger and SECRET not in log
    assert "task killed: cancelling SLURM job" in trigger_log(stack, dag_id, run_id, "round_1.site-2")
    assert slurm.jobs() == []
