"""The CLI's plumbing that needs no Airflow run: where `flare-airflow run` sends Airflow's output.

Run in a fresh interpreter: pytest's own capture replaces ``sys.stdout``, the command does not.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = """
import os, subprocess, sys
from flare_airflow.cli.dag_runs import _output_to
print("before", flush=True)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
try:
    with _output_to(fd):
        print("from python")
        os.write(2, b"from fd 2\\n")
        # A child inherits the redirected descriptors, as Airflow's task subprocesses do.
        subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
        if sys.argv[2] == "raise":
            raise RuntimeError("boom")
except RuntimeError:
    print("raised", flush=True)
print("after", flush=True)
print("stderr is back", file=sys.stderr)
"""


def run(log: pathlib.Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log), mode], capture_output=True, text=True, check=True, timeout=60
    )


def test_output_goes_to_the_log_and_comes_back(tmp_path: pathlib.Path) -> None:
    out = run(tmp_path / "run.log", "ok")
    assert (tmp_path / "run.log").read_text().splitlines() == ["from python", "from fd 2", "from a child"]
    assert out.stdout.splitlines() == ["before", "after"]
    assert out.stderr == "stderr is back\n"


def test_output_is_restored_when_the_body_raises(tmp_path: pathlib.Path) -> None:
    out = run(tmp_path / "run.log", "raise")
    assert (tmp_path / "run.log").read_text().splitlines() == ["from python", "from fd 2", "from a child"]
    assert out.stdout.splitlines() == ["before", "raised", "after"]
    assert out.stderr == "stderr is back\n"


def test_the_default_log_is_private_and_unpredictable(tmp_path: pathlib.Path, monkeypatch) -> None:
    from flare_airflow.cli.dag_runs import open_log

    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    fds = [open_log(None, "flare_demo") for _ in range(2)]
    try:
        path1, path2 = (path for _, path in fds)
        assert path1 != path2
        assert pathlib.Path(path1).parent == tmp_path / "logs" / "flare-airflow"
        assert pathlib.Path(path1).name.startswith("run-flare_demo-")
        assert pathlib.Path(path1).stat().st_mode & 0o777 == 0o600
    finally:
        for fd, _ in fds:
            os.close(fd)


def test_a_symlink_planted_at_the_log_path_is_not_followed(tmp_path: pathlib.Path) -> None:
    from flare_airflow.cli.dag_runs import CLIError, open_log

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = tmp_path / "run.log"
    planted.symlink_to(victim)
    with pytest.raises(CLIError, match="is a symbolic link; refusing to write through it"):
        open_log(str(planted), "flare_demo")
    assert victim.read_text() == "precious\n"


def test_a_dag_file_import_error_is_reduced_to_the_exception_and_its_message() -> None:
    from flare_airflow.cli.dag_runs import exception_text

    trace = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    build_dag(...)\n'
        "flare_airflow.core.errors.ConfigError: invalid job configuration:\n  job.yaml: rounds: must be an integer\n"
    )
    assert exception_text(trace) == "ConfigError: invalid job configuration:\n  job.yaml: rounds: must be an integer"


def test_validate_shows_what_a_multi_node_site_job_takes_of_its_pool(tmp_path: pathlib.Path, capsys) -> None:
    import yaml

    from flare_airflow.cli import main
    from flare_airflow_testing.harness import tiny_model

    tiny_model(tmp_path / "init.safetensors")
    k8s = {"image": "registry.example/t:1", "nodes": 2}
    job = {
        "job": "multi",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": "init.safetensors",
        "trainer": {"script": "train.py"},
        "sites": {
            "cluster": {
                "launcher": "k8s",
                "resource_spec": {"num_of_gpus": 2},
                "resource_manager": {"type": "gpu", "num_of_gpus": 4},
                "launcher_spec": {"k8s": k8s},
            }
        },
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["validate", str(tmp_path / "job.yaml")]) == 0
    assert "site cluster: launcher k8s, 2 nodes x 2 GPU(s) = 4 GPU(s)," in capsys.readouterr().out
