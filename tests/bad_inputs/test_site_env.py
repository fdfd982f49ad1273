"""Bad-input battery, category "site_env": what a site's host or its admin got wrong.

Each case runs the site runner (``run_site``, real processes) or the site task's secret
resolution against a broken environment and checks the user is told what, where and what to do.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import failure_path, record_path
from flare_airflow.launchers.process import ProcessLauncher
from flare_airflow.site_task.runner import run_site
from flare_airflow.site_task.spec import SiteRun
from tests.bad_inputs.cases import Case, assert_clear

PY = sys.executable
OK = (
    "import flare_airflow.client as flare\nm = flare.receive()\n"
    "flare.send(flare.FLModel(params=m.params, meta={'num_samples': 1}))\n"
)

RUNNER_CASES = [
    Case("site-cwd-missing", "site_env", "launcher_spec.process.cwd does not exist on the host",
         "the working directory '{tmp}/nowhere' does not exist on this host; "
         "create it or change the site's launcher_spec.process.cwd"),
    Case("site-cwd-is-a-file", "site_env", "cwd names a file", "is not a directory"),
    Case("site-interpreter-missing", "site_env", "trainer.command names an interpreter that is not installed",
         "cannot start '/opt/no-python/bin/python3': no such file"),
    Case("site-interpreter-not-on-path", "site_env", "trainer.command ['python9'] is not on PATH",
         "cannot start 'python9': the program was not found on PATH"),
    Case("site-interpreter-not-executable", "site_env", "trainer.command names a file without execute permission",
         "not an executable file"),
    Case("site-interpreter-is-a-directory", "site_env", "trainer.command names a directory", "not an executable file"),
    Case("site-script-missing", "site_env", "trainer.script does not exist on the site's host",
         "No such file or directory"),
    Case("site-env-nul-value", "site_env", "an env value with a NUL byte (set in Python, past validation)",
         "the value of environment variable 'TOKEN' contains a NUL byte"),
    Case("site-env-bad-name", "site_env", "a process env name with '='",
         "'A=B' cannot be an environment variable name"),
    Case("site-gpu-lock-dir-is-a-file", "site_env", "FLARE_GPU_LOCK_DIR names a file",
         "exists but is not a directory; remove it or the lock directory must be a directory writable"),
    Case("site-gpu-lock-dir-not-writable", "site_env", "FLARE_GPU_LOCK_DIR is not writable (/proc/sys)",
         "the GPU lock directory /proc/sys is not writable by this user"),
    Case("site-gpu-lock-dir-uncreatable", "site_env", "FLARE_GPU_LOCK_DIR lies under a file",
         "cannot create the GPU lock directory"),
    Case("site-gpus-more-than-host", "site_env", "the job asks for 4 GPUs, the host has 2",
         "asks for 4 GPU(s) but this host has only 2"),
    Case("site-global-model-missing", "site_env", "the round's input global model was removed from the store",
         "does not exist; re-run the task that published it"),
    Case("site-global-model-corrupted", "site_env", "the input global model's bytes changed after publication",
         "does not match its record"),
    Case("site-global-record-missing", "site_env", "the input global model's record (global.json) is missing",
         "has no record global.json (never completed)"),
    Case("site-global-record-corrupted", "site_env", "the input global model's record is not JSON",
         "its record global.json is corrupted (JSONDecodeError)"),
    Case("site-global-model-replaced", "site_env",
         "the input global model and its record were replaced by another valid model after publication",
         "is not the one its producer published"),
    Case("site-store-round-dir-is-a-file", "site_env", "the round's directory in the store is a file",
         "in the model store: Not a directory; check the store"),
]  # fmt: skip


# What a site task resolves on its worker in strict mode (a key registry on the API server): a
# variable the worker lacks is refused by the API server instead of read from the central metastore.
STRICT_CASES = [
    Case("site-strict-noise-secret-not-on-worker", "site_env",
         "strict mode, privacy adds noise, the site's worker has no AIRFLOW_VAR_FLARE_NOISE_SECRET",
         "'flare_noise_secret' is not in this worker's environment or secrets backend, and the API server refuses "
         "site tasks the central one (strict mode: a site keeps its own); set AIRFLOW_VAR_FLARE_NOISE_SECRET=\""),
    Case("site-strict-policy-not-on-worker", "site_env",
         "strict mode, the site's worker has no policy file and no AIRFLOW_VAR_FLARE_SITE_POLICY",
         "set AIRFLOW_VAR_FLARE_SITE_POLICY (the policy as YAML or JSON) in the environment of the site's worker"),
    Case("site-noise-secret-missing", "site_env",
         "privacy adds noise, no flare_noise_secret anywhere (one-machine mode)",
         "which this worker does not have; set AIRFLOW_VAR_FLARE_NOISE_SECRET=\"$(python -c"),
]  # fmt: skip
CASES = [*RUNNER_CASES, *STRICT_CASES]


@pytest.mark.parametrize("case", RUNNER_CASES, ids=[c.id for c in RUNNER_CASES])
def test_site_env_case(case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    global_model = store / "round-0000" / "global.safetensors"
    write_artifact(global_model, FLModel(params={"w": np.ones(3, np.float32)}))
    script = tmp_path / "trainer.py"
    script.write_text(OK)
    (tmp_path / "file").write_text("")
    (tmp_path / "noexec").write_text("#!/bin/sh\n")
    output = store / "round-0001" / "sites" / "site-1.safetensors"
    fields: dict[str, object] = {
        "job": "demo", "run_id": "r", "round": 1, "total_rounds": 1, "site": "site-1", "task": "train",
        "argv": [PY, str(script)], "global_model": str(global_model), "output": str(output),
        "staging": str(store / "round-0001" / "staging" / "site-1" / "try-1" / "update.safetensors"),
        "shutdown_timeout": 2.0,
    }  # fmt: skip
    gpu = {"assign_gpus": True, "num_gpus": 1, "gpu_capacity": 2, "gpu_wait_timeout": 1.0}
    match case.id:
        case "site-cwd-missing":
            fields["cwd"] = str(tmp_path / "nowhere")
        case "site-cwd-is-a-file":
            fields["cwd"] = str(tmp_path / "file")
        case "site-interpreter-missing":
            fields["argv"] = ["/opt/no-python/bin/python3", str(script)]
        case "site-interpreter-not-on-path":
            fields["argv"] = ["python9", str(script)]
        case "site-interpreter-not-executable":
            fields["argv"] = [str(tmp_path / "noexec"), str(script)]
        case "site-interpreter-is-a-directory":
            fields["argv"] = [str(tmp_path), str(script)]
        case "site-script-missing":
            fields["argv"] = [PY, str(tmp_path / "missing_train.py")]
        case "site-env-nul-value":
            fields["env"] = {"TOKEN": "abc\0def"}
        case "site-env-bad-name":
            fields["env"] = {"A=B": "x"}
        case "site-gpu-lock-dir-is-a-file":
            monkeypatch.setenv("FLARE_GPU_LOCK_DIR", str(tmp_path / "file"))
            fields.update(gpu)
        case "site-gpu-lock-dir-not-writable":
            monkeypatch.setenv("FLARE_GPU_LOCK_DIR", "/proc/sys")
            fields.update(gpu)
        case "site-gpu-lock-dir-uncreatable":
            monkeypatch.setenv("FLARE_GPU_LOCK_DIR", str(tmp_path / "file" / "locks"))
            fields.update(gpu)
        case "site-gpus-more-than-host":
            monkeypatch.setenv("FLARE_GPU_LOCK_DIR", str(tmp_path / "locks"))
            fields.update(gpu, num_gpus=4)
        case "site-global-model-missing":
            global_model.unlink()
        case "site-global-model-corrupted":
            global_model.write_bytes(global_model.read_bytes()[:-1] + b"\x7f")
        case "site-global-record-missing":
            record_path(global_model).unlink()
        case "site-global-record-corrupted":
            record_path(global_model).write_text("{")
        case "site-global-model-replaced":
            fields["global_sha256"] = "0" * 64
        case "site-store-round-dir-is-a-file":
            (store / "round-0001").write_text("")
    lines: list[str] = []
    try:
        rc, result = run_site(SiteRun(**fields), ProcessLauncher(sink=lines.append), handle_signals=False)  # type: ignore[arg-type]
    except OSError as exc:
        pytest.fail(f"{case.id}: {type(exc).__name__} escaped the site runner: {exc}")
    assert rc is not JobReturnCode.SUCCESS, f"{case.id}: accepted: {result}"
    assert isinstance(result, str)
    message = result + "\n" + "\n".join(lines[-5:])
    assert_clear(Case(case.id, case.category, case.bad_input, case.error.format(tmp=tmp_path)), message)
    assert "abc\0def" not in message
    if case.id == "site-store-round-dir-is-a-file":
        return  # nowhere to leave a failure record: the reason travels in the task's error
    assert not output.exists() and failure_path(output).exists()
    assert json.loads(failure_path(output).read_text())["reason"] == result


def test_a_trainer_printing_its_secret_shows_stars_in_every_line(tmp_path: pathlib.Path) -> None:
    store = tmp_path / "store"
    global_model = store / "round-0000" / "global.safetensors"
    write_artifact(global_model, FLModel(params={"w": np.ones(3, np.float32)}))
    script = tmp_path / "leaky.py"
    script.write_text("import os, sys\nprint('first line:', os.environ['API_TOKEN'], flush=True)\nsys.exit(3)\n")
    run = SiteRun(
        job="demo", run_id="r", round=1, total_rounds=1, site="site-1", task="train",
        argv=[PY, str(script)], global_model=str(global_model),
        output=str(store / "round-0001" / "sites" / "site-1.safetensors"), shutdown_timeout=2.0,
    )  # fmt: skip
    lines: list[str] = []
    canary = "canary-6f1d0c"
    launcher = ProcessLauncher(sink=lines.append, hidden=[canary])
    rc, result = run_site(run, launcher, handle_signals=False, secrets={"API_TOKEN": canary})
    assert rc is JobReturnCode.EXECUTION_ERROR
    assert any("first line: ***" in line for line in lines), lines
    assert canary not in "\n".join(lines) + str(result)


class _Refusing:
    """The Task SDK's channel to the Execution API, answering every request as the strict-mode
    API server answers a site task's request for a variable its grant does not list."""

    def send(self, msg: object) -> object:
        from airflow.sdk.exceptions import ErrorType
        from airflow.sdk.execution_time.comms import ErrorResponse

        return ErrorResponse(error=ErrorType.PERMISSION_DENIED, detail={"message": "refused by flare-airflow"})


@pytest.mark.parametrize("case", STRICT_CASES, ids=[c.id for c in STRICT_CASES])
def test_a_site_variable_missing_on_the_worker_says_what_to_set_there(
    case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.sdk.execution_time import task_runner

    from flare_airflow.core.errors import ConfigError
    from flare_airflow.operators.site_steps import SiteJobFailed, noise_secret_for, site_policy
    from tests.unit.airflow_layer import make_job

    for name in ("AIRFLOW_VAR_FLARE_NOISE_SECRET", "AIRFLOW_VAR_FLARE_SITE_POLICY", "FLARE_SITE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    if case.id.startswith("site-strict-"):
        # The real SDK chain (worker env, then the Execution API) with the API server's refusal.
        monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", _Refusing(), raising=False)
    job = make_job(
        tmp_path,
        privacy={"filters": [{"type": "gaussian", "clip": 1.0, "noise_multiplier": 1.0}], "delta": 1.0e-5},
    )
    plan = job.privacy_plan("site-1")
    assert plan is not None
    run = type("Run", (), {"site": "site-1", "privacy": plan.to_dict()})()
    with pytest.raises((SiteJobFailed, ConfigError)) as info:
        site_policy() if case.id == "site-strict-policy-not-on-worker" else noise_secret_for(run)  # type: ignore[arg-type]
    if case.id == "site-strict-policy-not-on-worker":
        # A ConfigError: job_at_site turns it into the site's failure record, as any bad policy.
        assert isinstance(info.value, ConfigError)
    assert_clear(case, str(info.value))
    assert "airflow variables set" not in str(info.value)
