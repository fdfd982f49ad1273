"""What a trainer starts with, and launch errors that say what is wrong
(flare_airflow.launchers.process.environment)."""

from __future__ import annotations

import json

import pytest

from flare_airflow.launchers.process import LaunchError, ProcessLauncher, trainer_environment
from tests.unit.launchers.process.jobs import PY, RC, site_job


def test_missing_executable_raises_launch_error(tmp_path) -> None:
    with pytest.raises(LaunchError, match=r"demo/site-1/r2: cannot start '/nonexistent/trainer': no such file"):
        ProcessLauncher().launch_job(site_job(["/nonexistent/trainer", "--x"]))
    with pytest.raises(LaunchError, match="cannot start"):
        ProcessLauncher().launch_job(site_job([PY, "-c", "pass"], cwd=str(tmp_path / "no-such-dir")))
    with pytest.raises(LaunchError, match="empty argv"):
        ProcessLauncher().launch_job(site_job([]))


def test_airflow_variables_do_not_reach_the_trainer(write_script, tmp_path, lines, monkeypatch) -> None:
    secrets = {
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://airflow:s3cret@db/airflow",
        "AIRFLOW_CONN_X": "s3://key:s3cret@bucket",
        "AIRFLOW_VAR_TOKEN": "s3cret-token",
        "AIRFLOW__CORE__FERNET_KEY": "s3cret-fernet",
        "_AIRFLOW_PARSING_CONTEXT_DAG_ID": "demo",
        "FLARE_SITE_JOB_SPEC": '{"secret": "s3cret"}',
    }
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SITE_POLICY_VISIBLE", "yes")
    dump = write_script("dump_env.py", "import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1], 'w'))\n")
    out = tmp_path / "env.json"
    job = site_job([PY, str(dump), str(out)], env={"FLARE_SITE": "site-1", "EXTRA": "from-the-job"})
    assert ProcessLauncher(sink=lines).launch_job(job).wait(timeout=30) is RC.SUCCESS
    env = json.loads(out.read_text())
    assert not [key for key in env if key.startswith(("AIRFLOW", "_AIRFLOW", "FLARE_SITE_JOB_SPEC"))]
    assert not [key for key, value in env.items() if "s3cret" in value]
    assert env["SITE_POLICY_VISIBLE"] == "yes"
    assert env["FLARE_SITE"] == "site-1"
    assert env["EXTRA"] == "from-the-job"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_trainer_environment() -> None:
    base = {"PATH": "/bin", "AIRFLOW_HOME": "/a", "AIRFLOW_CONN_DB": "x", "HOME": "/h", "PYTHONUNBUFFERED": "0"}
    env = trainer_environment(base, {"FLARE_ROUND": "1"})
    assert env == {"PATH": "/bin", "HOME": "/h", "PYTHONUNBUFFERED": "0", "FLARE_ROUND": "1"}
    assert base["AIRFLOW_HOME"] == "/a", "the worker's environment is not modified"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"cwd": "{tmp}/missing"}, "the working directory '{tmp}/missing' does not exist on this host"),
        ({"cwd": "{tmp}/file"}, "the working directory '{tmp}/file' is not a directory"),
        ({"argv": ["no-such-trainer-program"]}, "cannot start 'no-such-trainer-program': the program was not found"),
        ({"argv": ["{tmp}/file"]}, "cannot start '{tmp}/file': not an executable file"),
        ({"argv": ["{tmp}"]}, "cannot start '{tmp}': not an executable file"),
        ({"env": {"TOKEN": "a\0b"}}, "the value of environment variable 'TOKEN' contains a NUL byte"),
        ({"env": {"A=B": "x"}}, "'A=B' cannot be an environment variable name"),
    ],
)
def test_launch_errors_say_what_is_wrong(tmp_path, kw, message) -> None:
    (tmp_path / "file").write_text("not a program")
    fields = {"argv": [PY, "-c", "pass"]}
    for key, value in kw.items():
        if isinstance(value, str):
            value = value.format(tmp=tmp_path)
        elif isinstance(value, list):
            value = [v.format(tmp=tmp_path) for v in value]
        fields[key] = value
    argv = fields.pop("argv")
    with pytest.raises(LaunchError) as info:
        ProcessLauncher().launch_job(site_job(argv, **fields))
    assert message.format(tmp=tmp_path) in str(info.value)
    assert "a\0b" not in str(info.value)
