"""SiteJobSensor under the real scheduler (PostgreSQL, LocalExecutor) on Kubernetes sites (real
control plane; the LOCAL NODE AGENT test harness plays the kubelet) and SLURM sites (real daemons).

* The worker running a sensor is killed (``kill -9`` of the task process and its supervisor) while
  the sensor waits: the scheduler fails that try, the next try re-attaches to the same pod -- one
  pod per site round in the API audit, not two -- or SLURM job (one per site round in ``squeue -t
  all``), and the run completes. Clearing the watch afterwards reports the published update.
* In ``reschedule`` mode no worker slot is held between pokes: the sensors sit in
  ``up_for_reschedule`` while the pool counts no running slot.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from flare_airflow_testing.harness import tiny_model
from flare_airflow_testing.k8s.audit import AuditLog
from flare_airflow_testing.k8s.kube import wait_for
from flare_airflow_testing.k8s.node_agent import NodeAgent
from flare_airflow_testing.slurm.cluster import SlurmCluster
from flare_airflow_testing.stack import HEARTBEAT_DRILL_ENV, AirflowStack, Postgres, alive, kill9, scheduler_stack
from tests.integration.k8s.test_site_pod_operator import TRAINER, pods

MARKING_DAG = '''
import os
from pathlib import Path

from flare_airflow.builder import build_dag
from flare_airflow.sensors.site_job import SiteJobSensor

HERE = Path(__file__).parent
dag = build_dag(HERE / "job.yaml", default_args={"mode": (HERE / "mode").read_text().strip()})

for task in dag.tasks:
    if isinstance(task, SiteJobSensor):
        def poke(context, _poke=task.poke):
            """Test hook: each poke says which process runs it, for the test to kill."""
            ti = context["ti"]
            (HERE / f"poked-{ti.task_id}-{ti.try_number}").write_text(f"{os.getpid()} {os.getppid()}")
            return _poke(context)

        task.poke = poke
'''


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, slurm_cluster: SlurmCluster, postgres: Postgres
) -> Iterator[AirflowStack]:
    env = {
        **slurm_cluster.env,  # the workers are the SLURM sites' submit hosts
        **HEARTBEAT_DRILL_ENV,  # a killed worker stops heartbeating: the scheduler fails its try after 12 s
        "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "False",  # the sensors poke from the worker
    }
    with scheduler_stack(tmp_path_factory.mktemp("sensor-drill"), env, postgres=postgres) as airflow:
        yield airflow


def write_job(
    stack: AirflowStack, control_plane: Any, namespace: str, name: str, mode: str, backend: str = "k8s"
) -> pathlib.Path:
    store = stack.root / "store"
    store.mkdir(exist_ok=True)
    folder = stack.dags / name.replace("-", "_")
    folder.mkdir()
    k8s_spec = {
        "image": "registry.example/flare/trainer:1",
        "namespace": namespace,
        "config_file": str(control_plane.kubeconfig_path()),
        "store_mount": {"host_path": str(store), "mount_path": "/flare-store"},
        "trainer_command": [sys.executable],
        "trainer_script": str(TRAINER),
        "poll_interval": 1,
    }
    job = {
        "job": name,
        "rounds": 1,
        "min_clients": 2,
        "store": str(store),
        "initial_model": str(tiny_model(folder / "init.safetensors")),
        "trainer": {
            "script": str(TRAINER),
            "args": ["--release", str(folder / "release")],
            "shutdown_timeout": 2,
            "command": [sys.executable],
        },
        "evaluate": False,
        "sites": {
            "@default": {
                "retries": 1,
                "retry_delay_seconds": 1,
                "launcher": backend,
                "watch": "sensor",
                "launcher_spec": {"k8s": k8s_spec}
                if backend == "k8s"
                else {"slurm": {"output_dir": str(folder / "out"), "poll_interval": 1}},
            },
            "site-1": {},
            "site-2": {},
        },
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    (folder / "mode").write_text(mode)
    (folder / "dag.py").write_text(MARKING_DAG)
    return folder


def pod_creates(audit: AuditLog, namespace: str, since: int) -> list[str]:
    audit.settle()
    return [
        str((ev.get("responseObject") or {}).get("metadata", {}).get("name") or ev["objectRef"].get("name"))
        for ev in audit.client_requests(namespace, since=since)
        if ev["verb"] == "create"
        and ev["objectRef"].get("resource") == "pods"
        and not ev["objectRef"].get("subresource")
    ]


def tries(stack: AirflowStack, dag_id: str, run_id: str, task_id: str) -> list[str]:
    body = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/tries")["task_instances"]
    return [t["state"] for t in sorted(body, key=lambda t: t["try_number"])]


def test_a_killed_sensor_worker_re_attaches_to_the_same_pod(
    stack: AirflowStack, control_plane, node_agent: NodeAgent, namespace: str, core: k8s.CoreV1Api, audit: AuditLog
) -> None:
    folder = write_job(stack, control_plane, namespace, "sensor-kill", "poke")
    dag_id = "flare_sensor_kill"
    mark = audit.mark()
    run_id = stack.trigger(dag_id)
    marker = folder / "poked-round_1.site-1-1"
    wait_for(marker.exists, 120, what="try 1 of the site-1 sensor pokes")
    task_process, supervisor = (int(p) for p in marker.read_text().split())
    running = pods(core, namespace)
    assert len(running) == 2, running
    # The worker dies while the sensor waits: no on_kill, no cleanup.
    kill9(supervisor)
    kill9(task_process)
    killed = time.monotonic()
    wait_for((folder / "poked-round_1.site-1-2").exists, 120, what="try 2 of the site-1 sensor pokes")
    print(f"\nsensor try 2 watching {time.monotonic() - killed:.1f} s after try 1's worker was killed")
    assert pods(core, namespace) == running, "try 2 watches the pod try 1 watched; nothing else was created"
    (folder / "release").touch()

    assert stack.wait_for_run(dag_id, run_id, timeout=240) == "success"
    tis = stack.task_instances(dag_id, run_id)
    assert {t: ti["state"] for t, ti in tis.items()} == dict.fromkeys(tis, "success")
    assert set(tis) == {
        "prepare",
        "round_1.site-1_launch",
        "round_1.site-1",
        "round_1.site-2_launch",
        "round_1.site-2",
        "round_1.global_model",
        "publish",
        "verdict",
        "sweep_pods",
    }
    assert tries(stack, dag_id, run_id, "round_1.site-1") == ["failed", "success"]
    assert tries(stack, dag_id, run_id, "round_1.site-1_launch") == ["success"]
    created = pod_creates(audit, namespace, mark)
    assert sorted(created) == sorted(running), f"one pod per site round: {created}"
    summary = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/round_1.site-1/xcomEntries/return_value")
    assert '"num_samples": 7' in str(summary["value"]).replace("'", '"')
    wait_for(lambda: pods(core, namespace) == [], 30, what="finished pods deleted")
    assert not alive(task_process) and not alive(supervisor)

    # Clearing the watch re-attaches to the finished job and reports its recorded result (the
    # pod is gone: the update it published), launching nothing.
    mark = audit.mark()
    stack.api(
        "POST",
        f"/dags/{dag_id}/clearTaskInstances",
        json={"dry_run": False, "dag_run_id": run_id, "task_ids": ["round_1.site-1"], "only_failed": False},
    )
    wait_for(lambda: len(tries(stack, dag_id, run_id, "round_1.site-1")) == 3, 60, what="the cleared sensor's try")
    assert stack.wait_for_run(dag_id, run_id, timeout=120) == "success"
    assert tries(stack, dag_id, run_id, "round_1.site-1") == ["failed", "success", "success"]
    log = stack.api(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/round_1.site-1/logs/3", params={"full_content": True}
    )
    assert "its update was already published; reporting it" in json.dumps(log)
    again = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/round_1.site-1/xcomEntries/return_value")
    assert again["value"] == summary["value"]
    assert pod_creates(audit, namespace, mark) == [] and pods(core, namespace) == []


def test_in_reschedule_mode_no_worker_slot_is_held_between_pokes(
    stack: AirflowStack, control_plane, node_agent: NodeAgent, namespace: str, core: k8s.CoreV1Api
) -> None:
    folder = write_job(stack, control_plane, namespace, "sensor-resched", "reschedule")
    dag_id = "flare_sensor_resched"
    run_id = stack.trigger(dag_id)
    sensors = ("round_1.site-1", "round_1.site-2")

    def both_waiting_and_no_slot() -> dict[str, Any] | None:
        tis = stack.task_instances(dag_id, run_id)
        pool = stack.api("GET", "/pools/default_pool")
        states = [tis.get(t, {}).get("state") for t in sensors]
        if states == ["up_for_reschedule"] * 2 and pool["running_slots"] == 0:
            return pool
        return None

    pool = wait_for(both_waiting_and_no_slot, 120, 0.3, what="both sensors rescheduled, no running slot")
    print(f"\nwhile both sensors wait for their pods: default_pool {pool}")
    for task_id in sensors:  # each sensor poked at least once and is waiting between pokes
        assert any(folder.glob(f"poked-{task_id}-1")), task_id
    assert len(pods(core, namespace)) == 2
    (folder / "release").touch()
    assert stack.wait_for_run(dag_id, run_id, timeout=240) == "success"
    tis = stack.task_instances(dag_id, run_id)
    assert {t: ti["state"] for t, ti in tis.items()} == dict.fromkeys(tis, "success")
    wait_for(lambda: pods(core, namespace) == [], 30, what="finished pods deleted")


def test_a_killed_sensor_worker_re_attaches_to_the_same_slurm_job(
    stack: AirflowStack, slurm: SlurmCluster, control_plane, namespace: str
) -> None:
    folder = write_job(stack, control_plane, namespace, "sensor-kill-slurm", "poke", backend="slurm")
    dag_id = "flare_sensor_kill_slurm"
    run_id = stack.trigger(dag_id)
    marker = folder / "poked-round_1.site-1-1"
    wait_for(marker.exists, 120, what="try 1 of the site-1 sensor pokes")
    task_process, supervisor = (int(p) for p in marker.read_text().split())

    def queued() -> list[list[str]]:
        return sorted(line.split()[:2] for line in slurm.jobs())  # id and name (the state moves on)

    first = queued()
    assert len(first) == 2, first
    kill9(supervisor)
    kill9(task_process)
    wait_for((folder / "poked-round_1.site-1-2").exists, 120, what="try 2 of the site-1 sensor pokes")
    assert queued() == first, "try 2 watches the job try 1 watched; nothing else was submitted"
    (folder / "release").touch()

    assert stack.wait_for_run(dag_id, run_id, timeout=240) == "success"
    tis = stack.task_instances(dag_id, run_id)
    assert {t: ti["state"] for t, ti in tis.items()} == dict.fromkeys(tis, "success")
    assert tries(stack, dag_id, run_id, "round_1.site-1") == ["failed", "success"]
    assert tries(stack, dag_id, run_id, "round_1.site-1_launch") == ["success"]
    # Every job slurmctld remembers (it keeps finished ones for MinJobAge): one per site round.
    names = [n for n in slurm.run("squeue", "-h", "-t", "all", "-o", "%j").stdout.split() if "-sensor-kill-slurm-" in n]
    assert sorted(names) == sorted(name for _, name in first), names
    assert not alive(task_process) and not alive(supervisor)
