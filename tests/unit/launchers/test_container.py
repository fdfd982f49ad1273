"""The container backend without an engine: the run command it builds and its state table."""

from __future__ import annotations

import json
import pathlib

import pytest

from flare_airflow.core.config import ContainerLaunchSpec, ResourceSpec
from flare_airflow.core.spec import JobIdentity, JobReturnCode, JobState, SiteJob
from flare_airflow.launchers.container import ContainerLauncher, launch_failure, map_container, run_command
from flare_airflow.launchers.container.naming import container_name, site_job_filters
from flare_airflow.launchers.container.state import never_started


def _job(tmp_path: pathlib.Path) -> SiteJob:
    model = tmp_path / "global" / "model.safetensors"
    model.parent.mkdir()
    model.write_bytes(b"x")
    model.with_suffix(".json").write_text("{}")
    env = {
        "FLARE_GLOBAL_MODEL": f"file://{model}",
        "FLARE_OUTPUT": str(tmp_path / "staging" / "update.safetensors"),
        "FLARE_SITE": "site-1",
    }
    return SiteJob("j", "manual__1", 2, "site-1", argv=("python", "/opt/t.py", "--x"), env=env, shutdown_timeout=7)


def test_the_run_command_keeps_the_sandbox_and_values_out_of_the_argv(tmp_path: pathlib.Path) -> None:
    spec = ContainerLaunchSpec.model_validate(
        {"image": "localhost/t:1", "gpu_devices": ["nvidia.com/gpu=0", "nvidia.com/gpu=1"], "env": {"A": "plain"}}
    )
    job = _job(tmp_path)
    identity = JobIdentity.of(job, 3)
    argv, env = run_command(
        spec,
        ResourceSpec.model_validate({"memory": "1Gi", "num_of_cpus": 2}),
        job,
        identity,
        gpu_devices=["nvidia.com/gpu=1"],
        secrets={"TOKEN": "s3cr3t"},
        environ={"PATH": "/usr/bin", "OPENBLAS_CORETYPE": "Haswell"},
    )
    text = " ".join(argv)
    for flag in ("--read-only", "--cap-drop ALL", "--security-opt no-new-privileges", "--network none",
                 "--user 1000:1000", "--memory 1073741824 --memory-swap 1073741824", "--cpus 2",
                 "--device nvidia.com/gpu=1", "--stop-timeout 7", "--pull missing"):  # fmt: skip
        assert flag in text, flag
    # attached: the engine's run returns the trainer's exit code; only terminate() stops the container
    assert "--detach" not in argv and "--sig-proxy=false" in argv
    model = tmp_path / "global" / "model.safetensors"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--volume"] == [
        f"{model}:{model}:ro",
        f"{model.with_suffix('.json')}:{model.with_suffix('.json')}:ro",
        f"{tmp_path / 'staging'}:{tmp_path / 'staging'}:rw",
    ]
    assert "s3cr3t" not in text and "Haswell" not in text
    assert {"TOKEN", "OPENBLAS_CORETYPE", "FLARE_SITE"} <= {argv[i + 1] for i, a in enumerate(argv) if a == "--env"}
    assert (env["TOKEN"], env["OPENBLAS_CORETYPE"], env["PATH"]) == ("s3cr3t", "Haswell", "/usr/bin")
    assert argv[-5:] == ["--", "localhost/t:1", "python", "/opt/t.py", "--x"]
    assert "flare-airflow.try=3" in {argv[i + 1] for i, a in enumerate(argv) if a == "--label"}
    assert container_name(identity).startswith("fl-j-site-1-r2-") and container_name(identity).endswith("-t3")
    assert "label=flare-airflow.try=3" in site_job_filters(identity, with_try=True)
    assert "label=flare-airflow.try=3" not in site_job_filters(identity, with_try=False)


@pytest.mark.parametrize(
    ("state", "terminated", "memory", "expected"),
    [
        ({"Status": "created"}, False, None, (JobState.STARTING, JobReturnCode.UNKNOWN, "")),
        ({"Status": "running"}, False, None, (JobState.RUNNING, JobReturnCode.UNKNOWN, "")),
        ({"Status": "exited", "ExitCode": 0}, False, None, (JobState.SUCCEEDED, JobReturnCode.SUCCESS, "")),
        ({"Status": "exited", "ExitCode": 3}, False, None,
         (JobState.FAILED, JobReturnCode.EXECUTION_ERROR, "exit code 3")),
        ({"Status": "exited", "ExitCode": 103}, False, None,
         (JobState.FAILED, JobReturnCode.CONFIG_ERROR, "exit code 103 (CONFIG_ERROR)")),
        ({"Status": "exited", "ExitCode": 143}, True, None,
         (JobState.TERMINATED, JobReturnCode.ABORTED, "terminated (exit code 143)")),
        ({"Status": "exited", "ExitCode": 137}, False, None,
         (JobState.FAILED, JobReturnCode.EXECUTION_ERROR, "exit code 137 (SIGKILL)")),
        (None, False, None, (JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR,
                             "the container disappeared (removed by someone else)")),
        ({"Status": "weird"}, False, None, (JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR,
                                             "unknown container state 'weird'")),
    ],
)  # fmt: skip
def test_the_state_table(state, terminated, memory, expected) -> None:
    status = map_container(state, terminated=terminated, memory_limit=memory)
    assert (status.state, status.return_code, status.reason) == expected


def test_a_sigkill_under_a_memory_limit_is_named_oom() -> None:
    status = map_container({"Status": "exited", "ExitCode": 137}, terminated=False, memory_limit="64Mi")
    assert status.reason.startswith("OOMKilled: the trainer was killed (SIGKILL, exit code 137) under its memory limit")
    assert map_container({"Status": "exited", "OOMKilled": True, "ExitCode": 137}, terminated=False).reason.startswith(
        "OOMKilled: the trainer exceeded its memory limit"
    )


def test_launch_failures_say_pull_or_refused() -> None:
    assert launch_failure(125, "Error: initializing source docker://x: pinging container registry")[0] is (
        JobReturnCode.INFRASTRUCTURE_ERROR
    )
    assert launch_failure(125, "Error: invalid device")[0] is JobReturnCode.CONFIG_ERROR


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (None, True),
        ({"Status": "created", "StartedAt": "0001-01-01T00:00:00Z"}, True),
        ({"Status": "exited", "ExitCode": 127, "StartedAt": "0001-01-01T00:00:00Z"}, True),
        ({"Status": "exited", "ExitCode": 127, "StartedAt": "2026-12-02T03:00:00.1Z"}, False),
    ],
)
def test_an_engine_exit_code_is_a_launch_failure_only_when_the_container_never_started(state, expected) -> None:
    """``run`` exits 125-127 for the engine's failures and for a trainer exiting so: the start time tells."""
    assert never_started(state) is expected


class _AnsweringEngine(ContainerLauncher):
    """The engine's answers given (``ps`` lists ``listed``), its calls recorded: what the launcher
    asks of an engine, without one (the real engine's side is tests/integration/containers/)."""

    def __init__(self, listed: list[dict[str, object]], **kwargs: object) -> None:
        super().__init__(ContainerLaunchSpec.model_validate({"image": "trainer:1"}), **kwargs)  # type: ignore[arg-type]
        self.listed = listed
        self.calls: list[tuple[str, ...]] = []

    def engine(self, *args: str, env: object = None, timeout: float | None = None) -> str:
        self.calls.append(args)
        return json.dumps(self.listed) if args[0] == "ps" else ""


def test_earlier_tries_and_found_jobs_get_the_jobs_shutdown_timeout(tmp_path: pathlib.Path) -> None:
    """Not a fixed 10 s: the grace the try's own terminate gives (``trainer.shutdown_timeout``)."""
    listed = [{"Id": f"id{t}", "Names": [f"c-t{t}"], "Labels": {"flare-airflow.try": str(t)}} for t in (1, 2, 3)]
    launcher = _AnsweringEngine(listed, shutdown_timeout=3)
    identity = JobIdentity.of(_job(tmp_path), 3)
    assert launcher.terminate_earlier_tries(identity) == ["c-t1", "c-t2"]
    assert ("stop", "--time", "3", "id1", "id2") in launcher.calls
    assert ("rm", "--force", "id1", "id2") in launcher.calls
    found = launcher.find_job(identity)
    assert found is not None and found.job.shutdown_timeout == 3


def test_a_container_sites_launcher_takes_the_jobs_shutdown_timeout(tmp_path: pathlib.Path) -> None:
    from flare_airflow.operators.container import container_launcher
    from tests.unit.airflow_layer import make_job

    site = {"launcher": "container", "launcher_spec": {"container": {"image": "trainer:1"}}}
    trainer = {"script": "train.py", "shutdown_timeout": 4}
    job = make_job(tmp_path, trainer=trainer, min_clients=1, sites={"site-1": site})
    launcher = container_launcher(job, "site-1", try_number=2, sink=None, hidden=())
    assert launcher.shutdown_timeout == 4
