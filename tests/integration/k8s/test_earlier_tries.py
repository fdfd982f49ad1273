"""Pods of a killed try on the real control plane (the LOCAL NODE AGENT test harness plays the
kubelet and runs each pod's command as a local process).

A worker killed right after it created its pod leaves that pod running, unwatched. The next try of
the same site job deletes it (found by the job/run/round/site labels) before creating its own, and
the run's publish task sweeps whatever pod of the run is still left.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import numpy as np
import pytest
from airflow.sdk.exceptions import TaskDeferred
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from safetensors.numpy import load_file

from flare_airflow.core.model import read_record
from flare_airflow.core.store import ModelStore
from flare_airflow.operators.pod import SitePodOperator
from flare_airflow.operators.run import PublishOperator
from tests.integration.k8s.test_site_pod_operator import RUN_ID, context_for, make_op, pods, run_deferred
from tests.k8s_harness.kube import wait_for
from tests.k8s_harness.node_agent import NodeAgent


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


def test_publish_sweeps_the_pods_its_run_left_and_only_those(
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

    publish = PublishOperator(task_id="publish", job=ours.job)
    deleted = publish.sweep_site_pods({"run_id": RUN_ID})
    assert [d.split(" ")[0] for d in deleted] == [f"{namespace}/{our_pod}"]
    assert gone(core, namespace, our_pod)
    assert [p for p in pods(core, namespace)] == [other_pod], "another run's pod is left alone"
    # The other run's own sweep takes its pod.
    assert PublishOperator(task_id="publish", job=other.job).sweep_site_pods(other_context)
    wait_for(lambda: pods(core, namespace) == [], 30, what="every pod deleted")
