"""Pods of a killed try on the real control plane (the LOCAL NODE AGENT test harness plays the
kubelet and runs each pod's command as a local process).

A worker killed right after it created its pod leaves that pod running, unwatched. The next try of
the same site job deletes it (found by the job/run/round/site labels) before creating its own, and
the run's teardown task (sweep_pods) sweeps whatever pod of the run is still left.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import yaml
from airflow.sdk.exceptions import TaskDeferred
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from safetensors.numpy import load_file

from flare_airflow.core.model import read_record
from flare_airflow.core.store import ModelStore
from flare_airflow.operators.pod import SitePodOperator
from flare_airflow.operators.pod_sweep import SweepPodsOperator
from flare_airflow_testing.harness import tiny_model
from flare_airflow_testing.k8s.kube import wait_for
from flare_airflow_testing.k8s.node_agent import NodeAgent
from flare_airflow_testing.stack import HEARTBEAT_DRILL_ENV, AirflowStack, Postgres, alive, kill9, scheduler_stack
from tests.integration.k8s.test_site_pod_operator import RUN_ID, TRAINER, context_for, make_op, pods, run_deferred


def abandoned_try(op: SitePodOperator, context: dict[str, Any], core: k8s.CoreV1Api, namespace: str) -> str:
    """What a worker killed right after creating its pod leaves: the pod, running, and no one watching."""
    with pytest.raises(TaskDeferred):
        op.execute(context)
    assert op.pod is not None
    name = str(op.pod.metadata.name)
    wait_for(lambda: core.read_namespaced_pod(name, namespace).status.phase == "Running", 30, what=f"{name} running")
    return name


def gone(core: k8s.CoreV1Api, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except ApiException as exc:
        return exc.status == 404
    return False


def test_a_new_try_deletes_the_pod_of_the_killed_try_then_succeeds(
    tmp_path: pathlib.Path,
    control_plane,
    node_agent: NodeAgent,
    namespace: str,
    core: k8s.CoreV1Api,
) -> None:
    first, store = make_op(tmp_path, namespace, control_plane.kubeconfig, args=["--release", "/nonexistent/never"])
    first_pod = abandoned_try(first, context_for(first), core, namespace)
    first_processes = set(node_agent.running_processes())
    assert first_processes, "try 1's trainer runs as a process on the node"

    second, _ = make_op(tmp_path, namespace, control_plane.kubeconfig)
    context = context_for(second)
    context["ti"].try_number = 2
    deleted: list[list[str]] = []
    delete_earlier_tries = second.delete_earlier_tries

    def spy(ctx: Any) -> list[str]:
        deleted.append(delete_earlier_tries(ctx))
        return deleted[-1]

    second.delete_earlier_tries = spy  # type: ignore[method-assign]
    started = time.monotonic()
    summary = run_deferred(second, context)
    print(f"\ntry 2 (deleting try 1's pod first) took {time.monotonic() - started:.1f} s")

    assert gone(core, namespace, first_pod), "try 1's pod was deleted"
    assert deleted == [[f"{first_pod} (try 1, Running)"]], "deleted by try 2 before it created its pod"
    wait_for(lambda: not (set(node_agent.running_processes()) & first_processes), 30, what="try 1's trainer ended")
    assert pods(core, namespace) == []
    # Try 2's update is the one published; try 1's trainer never sent one.
    output = ModelStore(store).site_update("podjob", RUN_ID, 1, "site-1")
    assert read_record(output).sha256 == summary["sha256"]
    np.testing.assert_array_equal(load_file(str(output))["w"], np.ones(4, np.float32))
    staging = ModelStore(store).staging("podjob", RUN_ID, 1, "site-1", 1)
    assert not staging.exists()


def test_the_teardown_sweeps_the_pods_its_run_left_and_only_those(
    tmp_path: pathlib.Path, control_plane, node_agent: NodeAgent, namespace: str, core: k8s.CoreV1Api
) -> None:
    ours, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, args=["--release", "/nonexistent/never"])
    our_pod = abandoned_try(ours, context_for(ours), core, namespace)
    other, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, args=["--release", "/nonexistent/never"])
    other_context = {**context_for(other), "run_id": "manual__2026-12-01T00:00:00+00:00"}
    with pytest.raises(TaskDeferred):
        other.execute(other_context)
    assert other.pod is not None
    other_pod = str(other.pod.metadata.name)

    sweep = SweepPodsOperator(task_id="sweep_pods", job=ours.job)
    deleted = sweep.sweep_site_pods({"run_id": RUN_ID})
    assert [d.split(" ")[0] for d in deleted] == [f"{namespace}/{our_pod}"]
    assert gone(core, namespace, our_pod)
    assert [p for p in pods(core, namespace)] == [other_pod], "another run's pod is left alone"
    # The other run's own sweep takes its pod.
    assert SweepPodsOperator(task_id="sweep_pods", job=other.job).sweep_site_pods(other_context)
    wait_for(lambda: pods(core, namespace) == [], 30, what="every pod deleted")


# ---------------------------------------------------------------- the same on the real scheduler

STALLING_DAG = '''
import os
import time
from pathlib import Path

from airflow.providers.cncf.kubernetes.callbacks import KubernetesPodOperatorCallback

from flare_airflow.builder import build_dag
from flare_airflow.operators.pod import SitePodOperator

HERE = Path(__file__).parent


class StallAfterPodCreation(KubernetesPodOperatorCallback):
    """Test hook: while the file 'stall' exists, try 1 of round_1.site-1 stops right after its pod
    was created and says where it is, so that the test can kill its worker at that moment."""

    @staticmethod
    def on_pod_creation(*, pod, context, **kwargs):
        ti = context["ti"]
        if ti.task_id == "round_1.site-1" and ti.try_number == 1 and (HERE / "stall").exists():
            (HERE / "stalled").write_text(f"{os.getpid()} {os.getppid()} {pod.metadata.name}")
            time.sleep(600)


dag = build_dag(HERE / "job.yaml")
for task in dag.tasks:
    if isinstance(task, SitePodOperator):
        task.callbacks = [StallAfterPodCreation]
'''


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: Postgres) -> Iterator[AirflowStack]:
    # A killed worker stops heartbeating: the scheduler fails its try after 12 s. Pod tasks defer to
    # the triggerer, as the drill's try 2 expects.
    env = {**HEARTBEAT_DRILL_ENV, "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True"}
    with scheduler_stack(tmp_path_factory.mktemp("pod-drill"), env, postgres=postgres, triggerer=True) as airflow:
        yield airflow


def write_pod_job(stack: AirflowStack, control_plane, namespace: str) -> pathlib.Path:
    store = stack.root / "store"
    store.mkdir(exist_ok=True)
    folder = stack.dags / "pod_drill"
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
        "job": "pod-drill",
        "rounds": 1,
        "min_clients": 2,
        "store": str(store),
        "initial_model": str(tiny_model(folder / "init.safetensors")),
        "trainer": {"script": str(TRAINER), "args": ["--release", str(folder / "release")], "shutdown_timeout": 2},
        "evaluate": False,
        "sites": {
            "@default": {"retries": 1, "retry_delay_seconds": 1, "launcher": "k8s", "launcher_spec": {"k8s": k8s_spec}},
            "site-1": {},
            "site-2": {},
        },
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    (folder / "dag.py").write_text(STALLING_DAG)
    return folder


def final_tensors(stack: AirflowStack, dag_id: str, run_id: str) -> dict[str, Any]:
    body = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/publish/xcomEntries/return_value")
    value = body["value"]
    published = json.loads(value) if isinstance(value, str) else value
    return {k: v.tobytes() for k, v in load_file(published["final_model"].removeprefix("file://")).items()}


def test_worker_killed_right_after_pod_creation_on_the_real_scheduler(
    stack: AirflowStack, control_plane, node_agent: NodeAgent, namespace: str, core: k8s.CoreV1Api
) -> None:
    folder = write_pod_job(stack, control_plane, namespace)
    dag_id = "flare_pod_drill"
    (folder / "release").touch()  # trainers send at once
    baseline = stack.trigger(dag_id)
    assert stack.wait_for_run(dag_id, baseline, timeout=240) == "success"
    expected = final_tensors(stack, dag_id, baseline)

    # Trainers now wait for 'release': try 1's pod is still running when try 2 starts.
    (folder / "release").unlink()
    (folder / "stall").touch()
    run_id = stack.trigger(dag_id)
    wait_for(lambda: (folder / "stalled").exists(), 120, what="try 1 of site-1 created its pod")
    task_process, supervisor, first_pod = (folder / "stalled").read_text().split()
    (folder / "stall").unlink()
    wait_for(
        lambda: core.read_namespaced_pod(first_pod, namespace).status.phase == "Running", 30, what="try 1's pod runs"
    )
    first_processes = set(node_agent.running_processes())
    # The worker dies: its supervisor and the task process, with no chance to clean up.
    kill9(int(supervisor))
    kill9(int(task_process))
    killed = time.monotonic()
    wait_for(lambda: gone(core, namespace, first_pod), 120, what="try 1's pod deleted by try 2")
    print(f"\ntry 1's pod deleted {time.monotonic() - killed:.1f} s after its worker was killed")
    wait_for(
        lambda: [p for p in core.list_namespaced_pod(namespace, label_selector="flare-airflow/try=2").items],
        60,
        what="try 2's pod",
    )
    # Let try 2 settle as deferred before its trainer sends: a trigger that fires before the
    # scheduler processed the deferral's executor event trips Airflow's "state changed externally".
    time.sleep(3)
    (folder / "release").touch()

    assert stack.wait_for_run(dag_id, run_id, timeout=240) == "success"
    tis = stack.task_instances(dag_id, run_id)
    assert {t: ti["state"] for t, ti in tis.items()} == dict.fromkeys(tis, "success")
    tries = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/round_1.site-1/tries")["task_instances"]
    assert [t["state"] for t in sorted(tries, key=lambda t: t["try_number"])] == ["failed", "success"]
    log = stack.api(
        "GET",
        f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/round_1.site-1/logs/2",
        params={"full_content": True},
    )
    assert f"deleted the pods of earlier tries in {namespace}: {first_pod} (try 1, Running)" in json.dumps(log)
    assert final_tensors(stack, dag_id, run_id) == expected
    assert pods(core, namespace) == []
    wait_for(lambda: not (set(node_agent.running_processes()) & first_processes), 30, what="try 1's trainer ended")
    assert not alive(int(task_process)) and not alive(int(supervisor))
