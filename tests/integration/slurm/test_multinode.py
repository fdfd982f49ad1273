"""Multi-node site jobs on a real 2-node SLURM cluster: two slurmd, each in its own network
namespace with its own address on a private bridge (as two machines), one slurmctld. The trainer
runs once per node with torchrun's variables and really rendezvouses over TCP across the nodes."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from flare_airflow.core.config import SlurmLaunchSpec
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode, SiteJob
from flare_airflow.launchers.slurm import LocalCommands, SlurmLauncher
from flare_airflow_testing.harness import AirflowHome, tiny_model
from flare_airflow_testing.ports import free_port
from flare_airflow_testing.slurm.cluster import SlurmCluster

TRAINER = Path(__file__).parents[1] / "trainers" / "rendezvous_trainer.py"


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-2n"), nodes=2, gpus=1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(two_nodes: SlurmCluster) -> Iterator[SlurmCluster]:
    yield two_nodes
    left = two_nodes.settled_jobs()
    if left:
        two_nodes.cancel_all()
        pytest.fail(f"SLURM jobs left in the queue after the test: {'; '.join(left)}")


def test_two_nodes_rendezvous_and_rank_0_sends(cluster: SlurmCluster, tmp_path: Path) -> None:
    init = tmp_path / "global.safetensors"
    write_artifact(init, FLModel(params={"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}))
    out = tmp_path / "update.safetensors"
    env = {
        "FLARE_JOB": "demo",
        "FLARE_RUN_ID": "r",
        "FLARE_SITE": "site-1",
        "FLARE_ROUND": "1",
        "FLARE_TOTAL_ROUNDS": "1",
        "FLARE_TASK": "train",
        "FLARE_GLOBAL_MODEL": str(init),
        "FLARE_OUTPUT": str(out),
        "FLARE_HPARAMS": "{}",
    }
    lines: list[str] = []
    spec = SlurmLaunchSpec(nodes=2, output_dir=str(tmp_path / "out"), poll_interval=0.3)
    commands = LocalCommands({**os.environ, **cluster.env})
    job = SiteJob("demo", "r", 1, "site-1", (sys.executable, str(TRAINER)), env=env)
    handle = SlurmLauncher(spec, commands=commands, sink=lines.append).launch_job(job)
    assert handle.wait(90) is JobReturnCode.SUCCESS, "\n".join(lines)
    node1 = cluster.net.address(0) if cluster.net else ""
    assert f"[site-1 r1] rank 0 of 2 at {node1} gathered [0, 1]" in lines
    np.testing.assert_array_equal(load_file(str(out))["w"], np.full(4, 2.0, np.float32))  # rank 0's only


def test_one_node_dying_ends_the_whole_job(cluster: SlurmCluster, tmp_path: Path) -> None:
    spec = SlurmLaunchSpec(nodes=2, output_dir=str(tmp_path / "out"), poll_interval=0.3)
    commands = LocalCommands({**os.environ, **cluster.env})
    job = SiteJob("demo", "r", 1, "site-1", (sys.executable, str(TRAINER), "--die-rank", "1"))
    handle = SlurmLauncher(spec, commands=commands).launch_job(job)
    assert handle.wait(60) is JobReturnCode.EXECUTION_ERROR
    assert "the job failed" in handle.reason
    assert "task 1: Killed" in handle.reason or "Killed" in handle.reason, handle.reason


def test_a_two_node_site_in_a_federated_run(cluster: SlurmCluster, airflow_home: AirflowHome, tmp_path: Path) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    job = {
        "job": "two-nodes",
        "rounds": 1,
        "min_clients": 2,
        "initial_model": str(tiny_model(folder / "init.safetensors")),
        "trainer": {"script": str(TRAINER), "command": [sys.executable]},
        "evaluate": False,
        "sites": {
            "@default": {"retries": 0},
            "hpc": {
                "launcher": "slurm",
                "launcher_spec": {"slurm": {"nodes": 2, "output_dir": str(tmp_path / "out"), "poll_interval": 0.5}},
            },
        },
    }
    job["sites"]["local"] = {}
    job["trainer"]["args"] = []
    saved = dict(airflow_home.env)
    airflow_home.env.update(cluster.env)
    # The process site has no SLURM: its trainer runs as one rank of one.
    airflow_home.env["RANK"] = "0"
    airflow_home.env["WORLD_SIZE"] = "1"
    airflow_home.env["MASTER_ADDR"] = "127.0.0.1"
    # A free unprivileged port: the confined trainer runs as nobody with no capabilities.
    airflow_home.env["MASTER_PORT"] = str(free_port())
    try:
        result = airflow_home.run("flare_two_nodes", airflow_home.write_job("two_nodes", job))
    finally:
        airflow_home.env.clear()
        airflow_home.env.update(saved)
    assert result.tasks == {
        "prepare": "success",
        "round_1.hpc": "success",
        "round_1.local": "success",
        "round_1.global_model": "success",
        "publish": "success",
        "verdict": "success",
        "sweep_slurm_jobs": "success",
    }, result.log[-4000:]
    assert "[hpc r1] rank 0 of 2 at" in result.log and "gathered [0, 1]" in result.log
    # FedAvg by samples: hpc sent zeros + 2 with 2 samples, local zeros + 1 with 1 sample.
    final = load_file(result.metrics()["final_model"].removeprefix("file://"))
    np.testing.assert_allclose(final["w"], np.full(4, 5 / 3, np.float32), rtol=1e-6)
