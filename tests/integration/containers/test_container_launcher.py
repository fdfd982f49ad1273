"""The container launcher on real podman (rootful): states, reasons, and nothing left behind.

Each case runs the project's trainer image with a small Python program as the "trainer", through
:class:`ContainerLauncher` exactly as a site task does, and ends with no container of its site
job on the engine (``podman ps -a`` filtered by the job's labels).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flare_airflow.core.config import ContainerLaunchSpec, ResourceSpec
from flare_airflow.core.spec import JobIdentity, JobReturnCode, JobState, SiteJob
from flare_airflow.launchers.container import ContainerLauncher
from flare_airflow.launchers.errors import LaunchError
from flare_airflow_testing.containers import engine


def site_job(tmp_path: Path, code: str, *, site: str = "site-1", shutdown: float = 10.0) -> SiteJob:
    staging = tmp_path / "staging" / site / "try-1"
    staging.mkdir(parents=True, exist_ok=True)
    env = {"FLARE_OUTPUT": str(staging / "update.safetensors"), "FLARE_SITE": site, "PYTHONUNBUFFERED": "1"}
    return SiteJob(
        "cjob", f"run-{tmp_path.name}", 1, site, argv=("python", "-c", code), env=env, shutdown_timeout=shutdown
    )


def containers_of(job: SiteJob) -> list[str]:
    """Every container (any state) of this site job on the engine."""
    out = subprocess.run(
        [engine(), "ps", "-a", "--format", "{{.Names}}", "--filter", "label=flare-airflow.site=" + job.site,
         "--filter", "label=flare-airflow.run-id=" + job.run_id],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return out.split()


def launcher(
    image: str,
    resources: dict[str, object] | None = None,
    *,
    env: dict[str, str] | None = None,
    shutdown_timeout: float = 10.0,
    **block: object,
) -> ContainerLauncher:
    """A launcher on podman, or ``engine="docker"`` with ``env`` (DOCKER_HOST) pointing the CLI at an API."""
    spec = ContainerLaunchSpec.model_validate({"engine": "podman", "image": image, "pull": "never", **block})
    return ContainerLauncher(
        spec,
        ResourceSpec.model_validate(resources or {}),
        environ={**os.environ, **(env or {})},
        shutdown_timeout=shutdown_timeout,
    )


@pytest.fixture(params=["podman", "docker"])
def engine_block(request: pytest.FixtureRequest) -> dict[str, object]:
    """The same launcher code on both engines: docker's CLI against podman's Docker-compatible API
    (these machines have no Docker engine); ``podman ps`` then sees the docker CLI's containers too."""
    if request.param == "podman":
        return {"engine": "podman"}
    return {"engine": "docker", "env": request.getfixturevalue("docker_env")}


def test_a_trainer_runs_sandboxed_and_its_secret_stays_out_of_the_argv(
    trainer_image: str, tmp_path: Path, engine_block: dict
) -> None:
    code = (
        "import os, pathlib; out = pathlib.Path(os.environ['FLARE_OUTPUT']);"
        "out.write_text(os.environ['TOKEN'][::-1]); print('uid', os.getuid(), 'caps', "
        "open('/proc/self/status').read().split('CapEff:')[1].split()[0]);"
        "import socket; s = socket.socket(); s.settimeout(1)\n"
        "try: s.connect(('10.0.2.2', 80)); print('net yes')\n"
        "except OSError: print('net none')\n"
        "try: open('/etc/x', 'w'); print('rootfs writable')\n"
        "except OSError: print('rootfs read-only')"
    )
    job = site_job(tmp_path, code)
    runner = launcher(trainer_image, **engine_block)
    handle = runner.launch_job(job, {"secrets": {"TOKEN": "s3cr3t-value"}})
    inspected = json.loads(
        subprocess.run([engine(), "inspect", handle.container_id], capture_output=True, text=True, check=True).stdout
    )[0]
    assert handle.wait(60) is JobReturnCode.SUCCESS, handle.reason
    assert "s3cr3t-value" not in json.dumps(inspected["Args"]) + json.dumps(inspected["Config"]["Cmd"])
    host = inspected["HostConfig"]
    assert (host["ReadonlyRootfs"], inspected["Config"]["User"], host["NetworkMode"]) == (True, "1000:1000", "none")
    assert "no-new-privileges" in host["SecurityOpt"] and host["Privileged"] is False
    assert sorted(m["Destination"] for m in inspected["Mounts"]) == [str(Path(job.env["FLARE_OUTPUT"]).parent)]
    assert handle.logs().split() == ["uid", "1000", "caps", "0000000000000000", "net", "none", "rootfs", "read-only"]
    assert Path(job.env["FLARE_OUTPUT"]).read_text() == "eulav-t3rc3s"
    assert containers_of(job) == [], "the container is removed once its end was seen"


def test_a_crash_is_an_execution_error_with_the_exit_code(
    trainer_image: str, tmp_path: Path, engine_block: dict
) -> None:
    job = site_job(tmp_path, "import sys; print('diverged at step 3'); sys.exit(3)")
    handle = launcher(trainer_image, **engine_block).launch_job(job)
    assert handle.wait(60) is JobReturnCode.EXECUTION_ERROR
    assert (handle.state, handle.reason) == (JobState.FAILED, "exit code 3")
    assert "diverged at step 3" in handle.logs()
    assert containers_of(job) == []


def test_an_image_that_cannot_be_pulled_fails_fast(tmp_path: Path) -> None:
    job = site_job(tmp_path, "pass")
    runner = launcher("localhost:1/flare/no-such-trainer:1", pull="missing")
    started = time.monotonic()
    with pytest.raises(LaunchError, match="the image could not be pulled") as caught:
        runner.launch_job(job)
    assert caught.value.return_code is JobReturnCode.INFRASTRUCTURE_ERROR
    assert time.monotonic() - started < 30
    assert containers_of(job) == []


def test_an_oom_killed_trainer_is_named(trainer_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker_cwd = tmp_path / "worker-cwd"
    worker_cwd.mkdir()
    monkeypatch.chdir(worker_cwd)
    job = site_job(tmp_path, "b = [bytearray(1 << 20) for _ in range(1024)]; print('survived')")
    handle = launcher(trainer_image, resources={"memory": "64Mi"}).launch_job(job)
    assert handle.wait(60) is JobReturnCode.EXECUTION_ERROR
    # podman with runc on cgroup v1 does not set OOMKilled; the launcher names it either way
    assert handle.reason.startswith("OOMKilled: the trainer"), handle.reason
    assert handle.reason.endswith("raise resource_spec.memory"), handle.reason
    assert containers_of(job) == []
    assert list(worker_cwd.iterdir()) == []  # nothing of the engine's lands where the worker runs


def test_terminate_ends_a_trainer_that_ignores_sigterm(trainer_image: str, tmp_path: Path, engine_block: dict) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    )
    job = site_job(tmp_path, code, shutdown=1)
    handle = launcher(trainer_image, **engine_block).launch_job(job)
    assert handle.poll() is JobReturnCode.UNKNOWN
    started = time.monotonic()
    handle.terminate()
    assert time.monotonic() - started < 20
    assert (handle.state, handle.poll()) == (JobState.TERMINATED, JobReturnCode.ABORTED)
    assert containers_of(job) == []


def test_kill_9_of_the_task_then_a_sensor_reattaches_and_the_next_try_ends_it(
    trainer_image: str, tmp_path: Path
) -> None:
    """A task process that launched and was killed -9: its container runs on, unwatched. A sensor
    in another process finds it by its identity; the next try ends it before launching its own."""
    job = site_job(tmp_path, "import time; print('training', flush=True); time.sleep(600)")
    block = {"engine": "podman", "image": trainer_image, "pull": "never"}
    script = (
        "import json, os, sys, time\n"
        "from flare_airflow.core.config import ContainerLaunchSpec\n"
        "from flare_airflow.core.spec import SiteJob\n"
        "from flare_airflow.launchers.container import ContainerLauncher\n"
        "job = SiteJob(**json.loads(sys.argv[1]))\n"
        "ContainerLauncher(ContainerLaunchSpec.model_validate(json.loads(sys.argv[2]))).launch_job(job)\n"
        "print('launched', flush=True); time.sleep(600)\n"
    )
    meta = {"job": job.job, "run_id": job.run_id, "round": job.round, "site": job.site, "argv": list(job.argv),
            "env": dict(job.env), "shutdown_timeout": 1}  # fmt: skip
    task = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(meta), json.dumps(block)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert task.stdout is not None and task.stdout.readline().strip() == "launched"
    finally:
        os.kill(task.pid, signal.SIGKILL)
        task.wait()
    assert len(containers_of(job)) == 1, "kill -9 of the task leaves its container running"

    identity = JobIdentity.of(job, 1)
    watcher = launcher(trainer_image)
    found = watcher.find_job(identity)
    assert found is not None and found.poll() is JobReturnCode.UNKNOWN and found.state is JobState.RUNNING
    assert watcher.find_job(JobIdentity.of(job, 2)) is None

    # The trainer (PID 1 in its container) ignores SIGTERM: the job's 1 s grace, then SIGKILL.
    ended = launcher(trainer_image, shutdown_timeout=1).terminate_earlier_tries(JobIdentity.of(job, 2))
    assert len(ended) == 1 and ended[0].endswith("-t1")
    assert containers_of(job) == []
