"""SLURM sites reached through an Airflow SSH connection: a real sshd on loopback (key auth) in
front of the real SLURM daemons, the provider's SSHHook as the client."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from flare_airflow.core.config import SlurmLaunchSpec
from flare_airflow.core.spec import JobReturnCode, JobState, SiteJob
from flare_airflow.hooks.slurm import SshCommands, slurm_commands
from flare_airflow.launchers.slurm import SlurmCommandError, SlurmLauncher
from flare_airflow_testing.slurm.cluster import SlurmCluster
from flare_airflow_testing.slurm.sshd import Sshd

CONN = "hpc_login"


@pytest.fixture
def ssh_conn(sshd: Sshd, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", sshd.connection_uri_json())
    monkeypatch.delenv("SLURM_CONF", raising=False)  # only the login node knows the cluster
    return f"ssh:{CONN}"


def test_a_job_through_ssh_runs_streams_and_fails_with_its_reason(
    slurm: SlurmCluster, ssh_conn: str, tmp_path: Path
) -> None:
    commands = slurm_commands(ssh_conn)
    assert isinstance(commands, SshCommands)
    assert commands.home() == "/root"
    spec = SlurmLaunchSpec(connection=ssh_conn, output_dir=str(tmp_path / "out"), poll_interval=0.3)
    lines: list[str] = []
    code = "import sys; print('over ssh:', sys.argv[1:]); sys.exit(int(sys.argv[2]))"
    argv = (sys.executable, "-c", code, "$(id) 'x'", "4")
    handle = SlurmLauncher(spec, commands=commands, sink=lines.append).launch_job(
        SiteJob("demo", "manual__ssh", 1, "site-1", argv)
    )
    assert handle.wait(60) is JobReturnCode.EXECUTION_ERROR
    assert lines == ["[site-1 r1] over ssh: [\"$(id) 'x'\", '4']"]
    assert "exit code 4" in handle.reason and "over ssh:" in handle.reason
    commands.close()


def test_terminate_through_ssh_cancels_the_job(slurm: SlurmCluster, ssh_conn: str, tmp_path: Path) -> None:
    spec = SlurmLaunchSpec(connection=ssh_conn, output_dir=str(tmp_path / "out"), poll_interval=0.3)
    commands = slurm_commands(ssh_conn)
    handle = SlurmLauncher(spec, commands=commands).launch_job(
        SiteJob("demo", "manual__ssh", 1, "site-2", (sys.executable, "-c", "import time; time.sleep(300)"))
    )
    deadline = time.monotonic() + 30
    while handle.read_status().state is not JobState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.2)
    handle.terminate()
    assert handle.poll() is JobReturnCode.ABORTED
    assert slurm.settled_jobs() == []


def test_an_unknown_ssh_connection_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_NO_SUCH_LOGIN", raising=False)
    with pytest.raises(SlurmCommandError, match="cannot connect through the SSH connection 'no_such_login'"):
        slurm_commands("ssh:no_such_login").run(["true"])
