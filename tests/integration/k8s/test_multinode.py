"""Multi-node site jobs on the real control plane (``nodes: 2`` in the k8s block): one pod per node
and a headless Service from the one manifest builder, bound by the real scheduler, run by the node
agent, whose stand-in for a pod network and cluster DNS gives each pod of the group a network
namespace of its own and resolves ``<hostname>.<subdomain>`` as a cluster DNS would. The trainer
(``tests/integration/trainers/rendezvous_trainer.py``) really rendezvouses over TCP: rank 0 gathers
every rank's number at MASTER_ADDR:MASTER_PORT."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from kubernetes import client as k8s

from flare_airflow.core.model import read_artifact
from flare_airflow.core.spec import JobState
from flare_airflow.launchers.kubernetes import NODE_RANK_LABEL, KubernetesJobHandle
from tests.integration.k8s.test_kubernetes_launcher import GLOBAL, JOB, RC, RUN, Sites, alive, pid_of, sites, store
from tests.k8s_harness.kube import pod_dict, wait_for
from tests.k8s_harness.node_agent import NodeAgent

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
