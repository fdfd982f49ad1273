"""Multi-node site jobs on the real control plane (``nodes: 2`` in the k8s block): one pod per node
and a headless Service from the one manifest builder, bound by the real scheduler, run by the node
agent, whose stand-in for a pod network and cluster DNS gives each pod of the group a network
namespace of its own and resolves ``<hostname>.<subdomain>`` as a cluster DNS would. The trainer
(``tests/integration/trainers/rendezvous_trainer.py``) really rendezvouses over TCP: rank 0 gathers
every rank's number at MASTER_ADDR:MASTER_PORT."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from airflow.sdk.exceptions import TaskDeferred
from kubernetes import client as k8s
from safetensors.numpy import load_file

from flare_airflow.core.model import read_artifact
from flare_airflow.core.spec import JobState
from flare_airflow.core.store import ModelStore
from flare_airflow.launchers.kubernetes import NODE_RANK_LABEL, KubernetesJobHandle
from flare_airflow.operators.pod import SitePodOperator
from flare_airflow.operators.pod_sweep import SweepPodsOperator
from flare_airflow.operators.site_steps import SiteJobFailed
from flare_airflow_testing.harness import REPO
from flare_airflow_testing.k8s.kube import pod_dict, wait_for
from flare_airflow_testing.k8s.node_agent import NodeAgent
from tests.integration.k8s.test_kubernetes_launcher import GLOBAL, JOB, RC, RUN, Sites, alive, pid_of, sites, store
from tests.integration.k8s.test_site_pod_operator import RUN_ID, context_for, make_op, run_deferred

__all__ = ["sites", "store"]  # fixtures


def rendezvous(sites: Sites, *args: str) -> KubernetesJobHandle:
    launcher = sites.launcher(nodes=2, trainer_script="/opt/trainer/rendezvous_trainer.py")
    return sites.launch(launcher, "site-1", *args, shutdown_timeout=3)


def objects(core: k8s.CoreV1Api, namespace: str) -> list[str]:
    pods = [f"pod/{p.metadata.name}" for p in core.list_namespaced_pod(namespace).items]
    return pods + [f"service/{s.metadata.name}" for s in core.list_namespaced_service(namespace).items]


def test_two_pods_rendezvous_over_tcp_and_only_rank_0_sends(
    sites: Sites, core: k8s.CoreV1Api, namespace: str, node_agent: NodeAgent
) -> None:
    lines: list[str] = []
    handle = rendezvous(sites)
    handle.launcher.sink = lines.append
    group = handle.service_name
    assert group is not None and handle.names == [f"{group}-n0", f"{group}-n1"]
    pods = [pod_dict(core, namespace, name) for name in handle.names]
    assert [p["metadata"]["labels"][NODE_RANK_LABEL] for p in pods if p] == ["0", "1"]
    assert handle.wait(90) is RC.SUCCESS, handle.reason + "\n" + handle.logs()
    # Rank 0 was reached at its own address (not the host's loopback) under its DNS name.
    gathered = [line for line in lines if "gathered" in line]
    assert gathered == [f"[site-1 r1] (node 0) rank 0 of 2 at {group}-n0.{group} gathered [0, 1]"], lines
    params, record = read_artifact(sites.store.site_update(JOB, RUN, 1, "site-1"))
    for name, value in GLOBAL.items():
        np.testing.assert_array_equal(params[name], value + 2)  # rank 0's: global + world size
    assert record.num_samples == 2
    assert objects(core, namespace) == []  # pods and Service deleted on success
    assert not [d for d in os.listdir("/var/run/netns") if d.startswith(node_agent.network.bridge)]


def test_killing_one_pods_process_fails_the_group_and_deletes_every_pod_and_the_service(
    sites: Sites, core: k8s.CoreV1Api, namespace: str, node_agent: NodeAgent
) -> None:
    handle = rendezvous(sites, "--die-rank", "99")  # nobody dies by itself: every rank waits
    wait_for(lambda: handle.poll() is RC.UNKNOWN and handle.state is JobState.RUNNING, 30, 0.2, "group running")
    pods = [pod_dict(core, namespace, name) for name in handle.names]
    pids = [pid_of(p) for p in pods if p]
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    # Each pod is a host of its own on the harness's pod network, not the node's loopback.
    ips = [p["status"]["podIP"] for p in pods if p]
    assert len(set(ips)) == 2 and all(ip.startswith(node_agent.network.prefix + ".") for ip in ips), ips
    assert len(objects(core, namespace)) == 3
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    assert handle.wait(60) is RC.EXECUTION_ERROR
    assert time.monotonic() - t0 < 30
    # (the node agent reports any SIGKILL as OOMKilled, see its docstring)
    assert handle.reason.startswith(f"node rank 1 of 2 (pod {handle.names[1]}): "), handle.reason
    assert "exit code 137" in handle.reason
    assert objects(core, namespace) == []
    assert not alive(pids[0])  # rank 0's trainer went with its pod


def test_terminate_deletes_the_group(sites: Sites, core: k8s.CoreV1Api, namespace: str) -> None:
    handle = rendezvous(sites, "--die-rank", "99")
    wait_for(lambda: handle.poll() is RC.UNKNOWN and handle.state is JobState.RUNNING, 30, 0.2, "group running")
    pids = [pid_of(p) for p in (pod_dict(core, namespace, n) for n in handle.names) if p]
    handle.terminate()
    assert (handle.state, handle.poll()) == (JobState.TERMINATED, RC.ABORTED)
    assert objects(core, namespace) == []
    assert not any(alive(pid) for pid in pids)


# ---------------------------------------------------------------- through the Airflow pod operator

RENDEZVOUS = pathlib.Path(__file__).parents[1] / "trainers" / "rendezvous_trainer.py"


def group_op(tmp_path: pathlib.Path, namespace: str, kubeconfig: pathlib.Path, *args: str) -> SitePodOperator:
    op, _store = make_op(tmp_path, namespace, kubeconfig, args=args, nodes=2, trainer_script=str(RENDEZVOUS))
    return op


def test_the_site_task_runs_two_pods_as_one_site_job(
    tmp_path: pathlib.Path, control_plane, node_agent: NodeAgent, namespace: str, core: k8s.CoreV1Api
) -> None:
    op = group_op(tmp_path, namespace, control_plane.kubeconfig)
    summary = run_deferred(op, context_for(op))
    assert summary["site"] == "site-1" and summary["num_samples"] == 2  # rank 0's update
    update = load_file(str(ModelStore(tmp_path / "store").site_update("podjob", RUN_ID, 1, "site-1")))
    np.testing.assert_array_equal(update["w"], np.full(4, 2.0, np.float32))
    assert objects(core, namespace) == []


def test_one_pod_failing_fails_the_site_task_and_deletes_the_group(
    tmp_path: pathlib.Path, control_plane, node_agent: NodeAgent, namespace: str, core: k8s.CoreV1Api
) -> None:
    op = group_op(tmp_path, namespace, control_plane.kubeconfig, "--die-rank", "1")
    with pytest.raises(SiteJobFailed, match=r"node rank 1 of 2 \(pod fl-podjob-site-1-r1-[0-9a-f]{8}-n1\): .*137"):
        run_deferred(op, context_for(op))
    wait_for(lambda: objects(core, namespace) == [], 30, what="both pods and the Service deleted")


def test_killing_the_deferred_task_deletes_the_group(
    tmp_path: pathlib.Path, control_plane, node_agent: NodeAgent, namespace: str, core: k8s.CoreV1Api
) -> None:
    op = group_op(tmp_path, namespace, control_plane.kubeconfig, "--die-rank", "99")
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context_for(op))
    trigger = deferred.value.trigger
    assert trigger.group_pods == [f"{op.pod.metadata.name[:-3]}-n0", f"{op.pod.metadata.name[:-3]}-n1"]
    wait_for(lambda: len(node_agent.running_processes()) >= 2, 30, what="both trainers running")
    processes = set(node_agent.running_processes())

    async def run_then_kill() -> None:
        task = asyncio.ensure_future(trigger.run().__anext__())
        await asyncio.sleep(1)
        assert not task.done()
        task.cancel()
        await trigger.on_kill()

    asyncio.run(run_then_kill())
    wait_for(lambda: objects(core, namespace) == [], 30, what="both pods and the Service deleted")
    wait_for(lambda: not (set(node_agent.running_processes()) & processes), 30, what="both trainers gone")


KILLED_TASK = """
import pathlib, sys
from tests.integration.k8s.test_multinode import group_op
from tests.integration.k8s.test_site_pod_operator import context_for
tmp, namespace, kubeconfig = sys.argv[1:4]
op = group_op(pathlib.Path(tmp), namespace, pathlib.Path(kubeconfig), "--die-rank", "99")
op.deferrable = False
op.execute(context_for(op))  # waits in this process (sync mode) until it is killed
"""


def test_after_kill_9_of_the_task_the_next_try_and_the_sweep_leave_nothing(
    tmp_path: pathlib.Path, control_plane, node_agent: NodeAgent, namespace: str, core: k8s.CoreV1Api
) -> None:
    task = subprocess.Popen(
        [sys.executable, "-c", KILLED_TASK, str(tmp_path), namespace, str(control_plane.kubeconfig)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        wait_for(lambda: len(objects(core, namespace)) == 3, 60, what="the try's two pods and Service")
        wait_for(lambda: len(node_agent.running_processes()) >= 2, 30, what="both trainers running")
    finally:
        task.kill()  # kill -9: no on_kill, no finally
        task.wait(10)
    processes = set(node_agent.running_processes())
    time.sleep(1)
    left = objects(core, namespace)
    assert len(left) == 3, "nobody cleaned up after the killed task"
    # The next try deletes the killed try's whole group (pods and Service) before it starts its own.
    retry = group_op(tmp_path, namespace, control_plane.kubeconfig)
    context = context_for(retry)
    context["ti"].try_number = 2
    deleted: list[str] = []
    delete_earlier_tries = retry.delete_earlier_tries

    def spy(ctx: Any) -> list[str]:
        deleted.extend(delete_earlier_tries(ctx))
        return deleted

    retry.delete_earlier_tries = spy  # type: ignore[method-assign]
    assert run_deferred(retry, context)["num_samples"] == 2
    assert sorted(d.split(" (")[0].replace("service ", "service/") for d in deleted) == sorted(
        name.removeprefix("pod/") for name in left
    )
    assert objects(core, namespace) == []
    wait_for(lambda: not (set(node_agent.running_processes()) & processes), 30, what="try 1's trainers gone")
    assert SweepPodsOperator(task_id="sweep_pods", job=retry.job).sweep_site_pods({"run_id": RUN_ID}) == []
