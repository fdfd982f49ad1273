"""``flare-airflow try-trainer``: a trainer run by hand, through the site runner and the site task's checks.

Real processes (the CLI and the trainer), no Airflow: the command must work where only the job,
its trainer and its model are.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

REPO = pathlib.Path(__file__).resolve().parents[2]
BEHAVE = REPO / "tests" / "e2e" / "trainers" / "behave.py"


def job_file(tmp: pathlib.Path, *args: str, **site: object) -> pathlib.Path:
    save_file({"w": np.zeros(4, np.float32)}, str(tmp / "init.safetensors"))
    data = {
        "job": "tryme",
        "rounds": 3,
        "min_clients": 1,
        "initial_model": "init.safetensors",
        "trainer": {"script": str(BEHAVE), "args": list(args), "hparams": {"lr": 0.5, "epochs": 2}},
        "sites": {"site-1": site, "site-2": {}},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def try_trainer(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flare_airflow.cli", "try-trainer", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_an_accepted_update(tmp_path: pathlib.Path) -> None:
    job = job_file(tmp_path, "--echo-args", "echo.json")  # next to FLARE_OUTPUT: the trainer is confined
    work = tmp_path / "work"
    echo = work / "tryme" / "try-trainer" / "round-0002" / "staging" / "site-2" / "try-1" / "echo.json"
    out = try_trainer(str(job), "--site", "site-2", "--hparam", "lr=0.1", "--round", "2", "--workdir", str(work))
    assert out.returncode == 0, out.stderr
    assert "update accepted: FULL update of 2 sample(s), metrics train_loss=2" in out.stdout
    published = work / "tryme" / "try-trainer" / "round-0002" / "sites" / "site-2.safetensors"
    assert f"{published} (sha256 " in out.stdout
    from flare_airflow.core.model import read_artifact

    params, record = read_artifact(published)
    np.testing.assert_array_equal(params["w"], np.ones(4, np.float32))  # global (zeros) + 1, as sent
    assert record.num_samples == 2
    # the trainer saw the run's hyper-parameters with the override, and the round asked for
    assert json.loads(echo.read_text())["hparams"] == {"lr": 0.1, "epochs": 2}
    assert json.loads(echo.read_text())["round"] == "2"


def test_a_model_file_of_your_own(tmp_path: pathlib.Path) -> None:
    job = job_file(tmp_path)
    mine = tmp_path / "mine.safetensors"
    save_file({"w": np.full(4, 5, np.float32)}, str(mine))
    work = tmp_path / "work"
    out = try_trainer(str(job), "--site", "site-1", "--model", str(mine), "--workdir", str(work))
    assert out.returncode == 0, out.stderr
    from flare_airflow.core.model import read_artifact

    params, _ = read_artifact(work / "tryme" / "try-trainer" / "round-0001" / "sites" / "site-1.safetensors")
    np.testing.assert_array_equal(params["w"], np.full(4, 6, np.float32))


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("--fail", "FAILED [EXECUTION_ERROR]: trainer failed: exit code 3"),
        ("--nan", "NaN or infinite"),
        ("--shape", "shape"),
        ("--silent", "sent no update (did it call flare.send()?)"),
    ],
)
def test_a_failing_trainer_or_a_bad_update_is_named(tmp_path: pathlib.Path, flag: str, expected: str) -> None:
    job = job_file(tmp_path, flag, "site-1")
    work = tmp_path / "work"
    out = try_trainer(str(job), "--site", "site-1", "--workdir", str(work))
    assert out.returncode == 1, out.stdout + out.stderr
    assert expected in out.stderr, out.stderr
    assert f"work directory (kept): {work}" in out.stderr
    # nothing was published from a failed try
    assert not (work / "tryme" / "try-trainer" / "round-0001" / "sites" / "site-1.safetensors").exists()


def test_the_trainers_last_output_line_is_in_the_reason(tmp_path: pathlib.Path) -> None:
    out = try_trainer(str(job_file(tmp_path, "--fail", "site-1")), "--site", "site-1", "--workdir", str(tmp_path / "w"))
    assert "site-1: failing on purpose" in out.stderr.splitlines()[-2]


def test_secret_env_comes_from_this_shell(tmp_path: pathlib.Path) -> None:
    site = {"launcher_spec": {"process": {"secret_env": {"TOKEN": {"variable": "tok"}}}}}
    job = job_file(tmp_path, **site)
    out = try_trainer(str(job), "--site", "site-1", "--workdir", str(tmp_path / "w"))
    assert out.returncode == 0, out.stderr
    assert "secret_env TOKEN: try-trainer does not read Airflow's connections or variables" in out.stderr
    out = try_trainer(str(job), "--site", "site-1", "--workdir", str(tmp_path / "w2"), env={"TOKEN": "s3cr3t"})
    assert out.returncode == 0 and "TOKEN" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--site", "site-9"], "--site 'site-9': job 'tryme' has no such site; its sites: site-1, site-2"),
        (
            ["--site", "site-1", "--hparam", "lrr=1"],
            "--hparam 'lrr': not a hyper-parameter of job 'tryme'; known: epochs, lr",
        ),
        (["--site", "site-1", "--hparam", "lr"], "--hparam 'lr': write KEY=VALUE"),
        (
            ["--site", "site-1", "--hparam", "epochs=two"],
            "--hparam epochs must be an integer like the job's default 2, got 'two'",
        ),
        (["--site", "site-1", "--hparam", "lr=NaN"], "--hparam lr must be a finite number like the job's default 0.5"),
        (["--site", "site-1", "--model", "nope.safetensors"], "--model 'nope.safetensors': cannot read it"),
        (["--site", "site-1", "--round", "0"], "--round 0: must be from 1 to 1000"),
    ],
)
def test_bad_arguments_get_a_clear_error(tmp_path: pathlib.Path, argv: list[str], expected: str) -> None:
    out = try_trainer(str(job_file(tmp_path)), *argv, "--workdir", str(tmp_path / "w"))
    assert out.returncode == 2, out.stdout + out.stderr
    assert expected in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_slurm_sites_secret_env_comes_from_this_shell_too(tmp_path: pathlib.Path) -> None:
    """The drift issue 27 named: try-trainer read the process and k8s blocks' secret_env only."""
    site = {"launcher": "slurm", "launcher_spec": {"slurm": {"secret_env": {"CLUSTER_TOKEN": {"variable": "tok"}}}}}
    job = job_file(tmp_path, **site)
    out = try_trainer(str(job), "--site", "site-1", "--workdir", str(tmp_path / "w"))
    assert out.returncode == 0, out.stderr
    assert "secret_env CLUSTER_TOKEN: try-trainer does not read Airflow's connections or variables" in out.stderr
    out = try_trainer(str(job), "--site", "site-1", "--workdir", str(tmp_path / "w2"), env={"CLUSTER_TOKEN": "s3cr3t"})
    assert out.returncode == 0 and "CLUSTER_TOKEN" not in out.stderr, out.stderr
