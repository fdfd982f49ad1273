"""Kubernetes sites through real Airflow: site tasks are KubernetesPodOperator pods on a real
control plane (kube-apiserver, scheduler, controller-manager), run by the LOCAL NODE AGENT test
harness as local processes. The federated result must equal the process-sites run bitwise."""

from __future__ import annotations

import copy
import json
import pathlib
import shutil
import sys

import numpy as np
import pytest
import yaml
from kubernetes import client as k8s
from safetensors.numpy import load_file

from flare_airflow_testing.harness import REPO, AirflowHome, tiny_model
from flare_airflow_testing.ports import free_port

pytestmark = pytest.mark.e2e


def k8s_block(airflow_home: AirflowHome, namespace: str, kubeconfig: pathlib.Path, **extra) -> dict:
    airflow_home.store.mkdir(parents=True, exist_ok=True)
    return {
        "image": "registry.example/flare/digits-trainer:1",
        "namespace": namespace,
        "config_file": str(kubeconfig),
        "store_mount": {"host_path": str(airflow_home.store), "mount_path": "/flare-store"},
        # The node agent runs the container's command on this machine: the image's interpreter
        # and script are this repository's.
        "trainer_command": [sys.executable],
        "trainer_script": str(REPO / "examples" / "digits" / "trainer.py"),
        "pending_timeout": 60,
        "poll_interval": 1,
        **extra,
    }


def digits_job(airflow_home: AirflowHome, name: str, k8s_sites: list[str], block: dict) -> pathlib.Path:
    job = yaml.safe_load((REPO / "dags" / "digits.yaml").read_text())
    job["job"] = name
    job["initial_model"] = str(REPO / "examples" / "digits" / "initial_model.safetensors")
    job["trainer"]["script"] = str(REPO / "examples" / "digits" / "trainer.py")
    for site in k8s_sites:
        job["sites"][site] = {"launcher": "k8s", "launcher_spec": {"k8s": copy.deepcopy(block)}}
    return airflow_home.write_job(name.replace("-", "_"), job)


def test_all_kubernetes_sites_match_the_process_run_bitwise(
    airflow_home: AirflowHome, control_plane, node_agent, namespace: str, core: k8s.CoreV1Api
) -> None:
    block = k8s_block(airflow_home, namespace, control_plane.kubeconfig_path())
    sites = ["site-1", "site-2", "site-3", "site-4"]
    pods = airflow_home.run("flare_digits_pods", digits_job(airflow_home, "digits-pods", sites, block))
    assert pods.returncode == 0, pods.log[-6000:]
    assert set(pods.tasks.values()) == {"success"}
    assert {pods.tasks[f"round_{r}.{s}"] for r in range(1, 6) for s in sites} == {"success"}
    assert pods.metrics()["rounds"][-1]["evaluation"]["accuracy"] >= 0.90
    assert core.list_namespaced_pod(namespace).items == [], "every site pod is deleted when its task ends"

    local = airflow_home.run("flare_digits_local", digits_job(airflow_home, "digits-local", [], block))
    assert local.returncode == 0, local.log[-4000:]
    assert pods.state["published"]["sha256"] == local.state["published"]["sha256"]


def test_mixed_process_and_kubernetes_sites(
    airflow_home: AirflowHome, control_plane, node_agent, namespace: str
) -> None:
    block = k8s_block(airflow_home, namespace, control_plane.kubeconfig_path())
    dag_file = digits_job(airflow_home, "digits-mixed", ["site-2", "site-4"], block)
    result = airflow_home.run("flare_digits_mixed", dag_file, conf={"rounds": 2})
    assert result.returncode == 0, result.log[-6000:]
    assert result.tasks["round_1.site-2"] == "success" and result.tasks["round_2.site-4"] == "success"
    # site-2 and site-4 ran as pods, site-1 and site-3 as local processes
    assert "site site-2 round 1 pod fl-digits-mixed-site-2-r1-" in result.log
    assert "site site-4 round 2 pod fl-digits-mixed-site-4-r2-" in result.log
    assert "site job digits-mixed/site-1 round 1/2 (train)" in result.log
    assert "site site-1 round 1 pod" not in result.log
    shutil.rmtree(dag_file.parent)


def test_a_site_policy_on_the_worker_decides_the_pods_cluster_namespace_and_image(
    airflow_home: AirflowHome, control_plane, node_agent, namespace: str
) -> None:
    # The job file asks for another namespace and an image the node cannot pull: had the pods been
    # built from it, every round would fail. The worker's policy -- here the Airflow variable
    # flare_site_policy as the worker's own AIRFLOW_VAR_ sets it -- decides instead.
    asked = k8s_block(airflow_home, "the-job-asks-for-this-namespace", control_plane.kubeconfig_path())
    asked["image"] = "registry.example/flare/pull-error:1"
    dag_file = digits_job(airflow_home, "digits-policy", ["site-2", "site-4"], asked)
    site_block = k8s_block(airflow_home, namespace, control_plane.kubeconfig_path(), image="site/trainer:2")
    policy = {
        "sites": {
            "site-1": {},
            "site-3": {},
            "site-2": {"launcher": "k8s", "launcher_spec": {"k8s": site_block}},
            "site-4": {"launcher": "k8s", "launcher_spec": {"k8s": site_block}},
        }
    }
    airflow_home.env["AIRFLOW_VAR_FLARE_SITE_POLICY"] = json.dumps(policy)
    try:
        result = airflow_home.run("flare_digits_policy", dag_file, conf={"rounds": 1})
    finally:
        del airflow_home.env["AIRFLOW_VAR_FLARE_SITE_POLICY"]
    assert result.returncode == 0, result.log[-6000:]
    assert {result.tasks[f"round_1.site-{i}"] for i in range(1, 5)} == {"success"}
    ran = sorted(
        p.name.split("_")[1].rsplit("-", 1)[0] for p in (node_agent.work_dir / "pods").glob("*_fl-digits-policy-*")
    )
    assert ran == ["fl-digits-policy-site-2-r1", "fl-digits-policy-site-4-r1"]
    assert all(p.name.startswith(f"{namespace}_") for p in (node_agent.work_dir / "pods").glob("*_fl-digits-policy-*"))
    shutil.rmtree(dag_file.parent)


def test_a_two_node_kubernetes_site_in_a_federated_run(
    airflow_home: AirflowHome, control_plane, node_agent, namespace: str, core: k8s.CoreV1Api, tmp_path: pathlib.Path
) -> None:
    trainer = REPO / "tests" / "integration" / "trainers" / "rendezvous_trainer.py"
    block = k8s_block(airflow_home, namespace, control_plane.kubeconfig_path(), nodes=2, trainer_script=str(trainer))
    folder = tmp_path / "job"
    folder.mkdir()
    job = {
        "job": "k8s-two-nodes",
        "rounds": 1,
        "min_clients": 2,
        "store": str(airflow_home.store),
        "initial_model": str(tiny_model(folder / "init.safetensors")),
        "trainer": {"script": str(trainer), "command": [sys.executable]},
        "evaluate": False,
        "sites": {
            "@default": {"retries": 0},
            "cluster": {"launcher": "k8s", "launcher_spec": {"k8s": block}},
            "local": {},
        },
    }
    saved = dict(airflow_home.env)
    # The process site has no group: its trainer runs as one rank of one.
    # A free unprivileged port: the confined trainer runs as nobody with no capabilities (port 1
    # bound only while trainers ran as the root worker).
    airflow_home.env.update(
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    )
    try:
        result = airflow_home.run("flare_k8s_two_nodes", airflow_home.write_job("k8s_two_nodes", job))
    finally:
        airflow_home.env.clear()
        airflow_home.env.update(saved)
    assert result.tasks == {
        "prepare": "success",
        "round_1.cluster": "success",
        "round_1.local": "success",
        "round_1.global_model": "success",
        "publish": "success",
        "verdict": "success",
        "sweep_pods": "success",
    }, result.log[-4000:]
    assert "rank 0 of 2 at fl-k8s-two-nodes-cluster-r1-" in result.log and "gathered [0, 1]" in result.log
    # FedAvg by samples: the 2-node site sent zeros + 2 with 2 samples (rank 0's), local zeros + 1 with 1.
    final = load_file(result.metrics()["final_model"].removeprefix("file://"))
    np.testing.assert_allclose(final["w"], np.full(4, 5 / 3, np.float32), rtol=1e-6)
    assert core.list_namespaced_pod(namespace).items == [] and core.list_namespaced_service(namespace).items == []
