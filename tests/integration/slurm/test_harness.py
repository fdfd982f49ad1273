"""The SLURM test cluster itself: real daemons, GPUs enforced through --gres, nothing left behind."""

from __future__ import annotations

import time

from flare_airflow_testing.slurm.cluster import GPUS, SlurmCluster


def test_node_has_the_fake_gpus(slurm: SlurmCluster) -> None:
    out = slurm.run("scontrol", "-o", "show", "node", slurm.node).stdout
    assert f"Gres=gpu:{GPUS}" in out
    assert "State=IDLE" in out


def test_more_gpus_than_the_node_has_is_refused_at_submission(slurm: SlurmCluster) -> None:
    res = slurm.run("sbatch", "--parsable", f"--gres=gpu:{GPUS + 1}", "--wrap", "true", check=False)
    assert res.returncode != 0
    assert "Requested node configuration is not available" in res.stderr


def test_each_gpu_job_gets_its_own_device(slurm: SlurmCluster, tmp_path) -> None:
    ids = [
        slurm.run(
            "sbatch",
            "--parsable",
            "--gres=gpu:1",
            "-o",
            str(tmp_path / f"{n}.out"),
            "--wrap",
            "echo $CUDA_VISIBLE_DEVICES; sleep 2",
        ).stdout.strip()
        for n in range(GPUS)
    ]
    deadline = time.monotonic() + 30
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    seen = sorted((tmp_path / f"{n}.out").read_text().strip() for n in range(GPUS))
    assert len(ids) == GPUS
    assert seen == [str(n) for n in range(GPUS)]
