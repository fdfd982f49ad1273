"""SiteJobLaunchOperator + SiteJobSensor on Kubernetes sites, against the real control plane (the
LOCAL NODE AGENT test harness plays the kubelet and runs each pod's command as a local process).

The tasks run as Airflow runs them, in this process: ``execute`` / ``poke`` with a task context
whose XCom is a dict; the deferrable sensor's trigger runs to its event, then ``execute_complete``.
"""

from __future__ import annotations

import asyncio
import pathlib
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import yaml
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException, TaskDeferred
from kubernetes import client as k8s
from safetensors.numpy import load_file

from flare_airflow.core.failure_record import read_failure
from flare_airflow.core.spec import JobIdentity
from flare_airflow.core.store import ModelStore
from flare_airflow.operators.site_job import SiteJobLaunchOperator
from flare_airflow.sensors.site_job import SiteJobSensor
from flare_airflow_testing.k8s.kube import wait_for
from tests.integration.k8s.test_site_pod_operator import RUN_ID, make_op, pods


class Run:
    """One DAG run's task contexts, sharing one XCom table (what the Task SDK gives a task)."""

    def __init__(self) -> None:
        self.xcom: dict[tuple[str, str], Any] = {}

    def context(self, task_id: str, try_number: int = 1) -> dict[str, Any]:
        def push(key: str, value: Any) -> None:
            self.xcom[(task_id, key)] = value

        def pull(task_ids: str, key: str = "return_value") -> Any:
            return self.xcom.get((task_ids, key))

        ti = SimpleNamespace(
            dag_id="podjob_dag",
            task_id=task_id,
            map_index=-1,
            try_number=try_number,
            start_date=datetime.now(UTC),
            xcom_push=push,
            xcom_pull=pull,
        )
        return {
            "ti": ti,
            "task_instance": ti,
            "run_id": RUN_ID,
            "dag": SimpleNamespace(dag_id="podjob_dag"),
            "params": {},
        }

    def launch(self, op: SiteJobLaunchOperator, try_number: int = 1) -> dict[str, Any]:
        identity = op.execute(self.context(op.task_id, try_number))
        self.xcom[(op.task_id, "return_value")] = identity
        return identity


def tasks(tmp_path: pathlib.Path, namespace: str, kubeconfig: pathlib.Path, *, deferrable: bool = False, **kw: Any):
    fused, store = make_op(tmp_path, namespace, kubeconfig, **kw)
    launch = SiteJobLaunchOperator(task_id="site-1_launch", job=fused.job, site="site-1", round_num=1)
    watch = SiteJobSensor(
        task_id="site-1",
        job=fused.job,
        site="site-1",
        round_num=1,
        launch_task_id="site-1_launch",
        deferrable=deferrable,
        poke_interval=0.5,
    )
    return launch, watch, store


def test_launch_then_poke_publishes_the_update_and_a_cleared_sensor_reports_it_again(
    tmp_path, control_plane, node_agent, namespace, core: k8s.CoreV1Api
) -> None:
    release = tmp_path / "release"
    launch, watch, store = tasks(tmp_path, namespace, control_plane.kubeconfig, args=["--release", str(release)])
    run = Run()
    identity = run.launch(launch)
    assert JobIdentity.from_dict(identity) == JobIdentity("podjob", RUN_ID, 1, "site-1", 1)
    assert identity["backend"] == "k8s" and identity["namespace"] == namespace
    first_pods = pods(core, namespace)
    assert first_pods == [identity["pod"]]

    # The launch task's process was lost after the launch: the same try launches again, finds its pod.
    assert launch.execute(run.context("site-1_launch")) == identity
    assert pods(core, namespace) == first_pods, "one pod per site round, not two"

    assert watch.poke(run.context("site-1")) is False  # running
    release.touch()
    wait_for(lambda: watch.poke(run.context("site-1")) is not False, 60, 0.5, what="the sensor sees success")
    summary = run.xcom[("site-1", "return_value")]
    assert summary["site"] == "site-1" and summary["num_samples"] == 7
    update = ModelStore(store).site_update("podjob", RUN_ID, 1, "site-1")
    np.testing.assert_array_equal(load_file(str(update))["w"], np.ones(4, np.float32))
    wait_for(lambda: pods(core, namespace) == [], 30, what="the finished pod is deleted")

    # Cleared sensor, second try: the pod is gone; the recorded result is reported, nothing launched.
    again = Run()
    again.xcom[("site-1_launch", "return_value")] = identity
    result = watch.poke(again.context("site-1", try_number=2))
    assert result and result.xcom_value == summary  # type: ignore[union-attr]
    assert pods(core, namespace) == []


def test_a_deferred_sensor_waits_in_the_trigger_and_publishes(
    tmp_path, control_plane, node_agent, namespace, core
) -> None:
    launch, watch, store = tasks(tmp_path, namespace, control_plane.kubeconfig, deferrable=True)
    run = Run()
    run.launch(launch)
    context = run.context("site-1")
    with pytest.raises(TaskDeferred) as deferred:
        watch.execute(context)
    trigger = deferred.value.trigger
    assert trigger.serialize()[0] == "flare_airflow.triggers.pod_state.PodStateTrigger"
    assert trigger.serialize()[1]["delete_on_kill"] is False

    async def first_event() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("no event")

    event = asyncio.run(first_event())
    assert event["status"] == "success"
    summary = getattr(watch, deferred.value.method_name)(context, event)
    assert summary["num_samples"] == 7
    assert ModelStore(store).site_update("podjob", RUN_ID, 1, "site-1").exists()
    wait_for(lambda: pods(core, namespace) == [], 30, what="the finished pod is deleted")


def test_a_failing_job_fails_the_sensor_with_its_reason_and_log_or_skips_it_with_soft_fail(
    tmp_path, control_plane, node_agent, namespace, core
) -> None:
    launch, watch, store = tasks(tmp_path, namespace, control_plane.kubeconfig, args=["--exit", "103"], keep_pods=True)
    run = Run()
    run.launch(launch)

    def failed() -> str | None:
        try:
            watch.poke(run.context("site-1"))
        except AirflowFailException as exc:
            return str(exc)
        return None

    message = wait_for(failed, 60, 0.5, what="the sensor fails")
    assert "exit code 103 (CONFIG_ERROR)" in message and "[CONFIG_ERROR]" in message
    assert "its last log lines:" in message and "site site-1 round 1" in message, message
    recorded = read_failure(ModelStore(store).site_update("podjob", RUN_ID, 1, "site-1"))
    assert recorded is not None and "exit code 103" in recorded, "the aggregation reads the reason there"

    soft = SiteJobSensor(
        task_id="site-1", job=watch.job, site="site-1", round_num=1, launch_task_id="site-1_launch", soft_fail=True
    )
    with pytest.raises(AirflowSkipException):
        soft.execute(run.context("site-1"))
    for name in pods(core, namespace):  # kept for debugging: the test removes it
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    wait_for(lambda: pods(core, namespace) == [], 30, what="pods deleted")


def test_launch_and_sensor_both_follow_the_workers_site_policy(
    tmp_path, control_plane, node_agent, namespace, core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job file names a namespace that does not exist; the worker's site policy names the real
    one. The launch creates the pod there and the sensor finds it there."""
    declared = make_op(tmp_path, "not-this-one", control_plane.kubeconfig)[0].job
    k8s_block = declared.sites["site-1"].launcher_spec.k8s.model_dump(exclude_defaults=True)
    k8s_block["namespace"] = namespace
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"sites": {"site-1": {"launcher": "k8s", "launcher_spec": {"k8s": k8s_block}}}}))
    monkeypatch.setenv("FLARE_SITE_CONFIG", str(policy))
    launch = SiteJobLaunchOperator(task_id="site-1_launch", job=declared, site="site-1", round_num=1)
    watch = SiteJobSensor(task_id="site-1", job=declared, site="site-1", round_num=1, launch_task_id="site-1_launch")
    run = Run()
    assert run.launch(launch)["namespace"] == namespace
    result = wait_for(lambda: watch.poke(run.context("site-1")), 60, 0.5, what="the sensor sees success")
    assert result.xcom_value["num_samples"] == 7  # type: ignore[union-attr]
    wait_for(lambda: pods(core, namespace) == [], 30, what="the finished pod is deleted")


RENDEZVOUS = pathlib.Path(__file__).parents[1] / "trainers" / "rendezvous_trainer.py"


@pytest.mark.parametrize("deferrable", [False, True], ids=["poke", "deferred"])
def test_a_two_node_launch_is_watched_as_one_site_job(
    tmp_path, control_plane, node_agent, namespace, core: k8s.CoreV1Api, deferrable: bool
) -> None:
    launch, watch, store = tasks(
        tmp_path, namespace, control_plane.kubeconfig, deferrable=deferrable, nodes=2, trainer_script=str(RENDEZVOUS)
    )
    run = Run()
    run.launch(launch)
    assert len(pods(core, namespace)) == 2 and len(core.list_namespaced_service(namespace).items) == 1
    context = run.context("site-1")
    if deferrable:
        with pytest.raises(TaskDeferred) as deferred:
            watch.execute(context)
        trigger = deferred.value.trigger
        assert len(trigger.group_pods) == 2 and trigger.group_selector

        async def first_event() -> dict[str, Any]:
            async for event in trigger.run():
                return dict(event.payload)
            raise AssertionError("no event")

        summary = getattr(watch, deferred.value.method_name)(context, asyncio.run(first_event()))
    else:
        wait_for(lambda: watch.poke(context) is not False, 60, 0.5, what="the sensor sees the group succeed")
        summary = run.xcom[("site-1", "return_value")]
    assert summary["num_samples"] == 2  # rank 0's update: the group's world size
    update = ModelStore(store).site_update("podjob", RUN_ID, 1, "site-1")
    np.testing.assert_array_equal(load_file(str(update))["w"], np.full(4, 2.0, np.float32))
    wait_for(
        lambda: pods(core, namespace) == [] and not core.list_namespaced_service(namespace).items,
        30,
        what="both pods and the Service deleted",
    )
