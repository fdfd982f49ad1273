"""The site runner: launch a trainer, check what it sent, leave an update or a failure record."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import blake3
import numpy as np
import pytest

from flare_airflow.core.failure_record import read_failure
from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import failure_path, record_path
from flare_airflow.launchers.process import ProcessLauncher
from flare_airflow.site_task.runner import run_site
from flare_airflow.site_task.spec import SPEC_ENV, SUMMARY_PREFIX, SiteRun

PY = sys.executable
RC = JobReturnCode

TRAINER = """
import json, os, sys

import numpy as np

import flare_airflow.client as flare

mode = sys.argv[1]
if mode == "fail":
    print("about to fail", flush=True)
    sys.exit(int(sys.argv[2]))
model = flare.receive()
print("hparams", json.dumps(flare.get_hparams(), sort_keys=True), flush=True)
print("spec visible:", os.environ.get("FLARE_SITE_JOB_SPEC") is not None, flush=True)
w, b = model.params["w"], model.params["b"]
if mode == "nosend":
    sys.exit(0)
if mode == "evaluate":
    flare.send(flare.FLModel(metrics={"accuracy": 0.875}))
    sys.exit(0)
params = {
    "ok": {"w": w + 1, "b": b + 0.5},
    "shape": {"w": np.zeros((3, 3), np.float32), "b": b},
    "nan": {"w": np.where(w > 0, np.nan, w).astype(np.float32), "b": b},
    "dtype": {"w": w.astype(np.float64), "b": b},
    "extra": {"w": w, "b": b, "extra_layer": np.zeros(2, np.float32)},
    "missing": {"w": w},
}[mode]
flare.send(flare.FLModel(params=params, metrics={"loss": 0.25}, meta={"num_samples": 12}))
"""


@pytest.fixture
def trainer(write_script) -> pathlib.Path:
    return write_script("trainer.py", TRAINER)


@pytest.fixture
def output(global_model: pathlib.Path) -> pathlib.Path:
    return global_model.parent.parent / "round-0001" / "sites" / "site-1.safetensors"


def make_run(trainer: pathlib.Path, global_model: pathlib.Path, output: pathlib.Path, *args: str, **kw) -> SiteRun:
    fields = {
        "job": "demo",
        "run_id": "manual__2024-01-01T00:00:00+00:00",
        "round": 1,
        "total_rounds": 3,
        "site": "site-1",
        "task": "train",
        "argv": [PY, str(trainer), *args],
        "global_model": str(global_model),
        "output": str(output),
        "hparams": {"lr": 0.1, "epochs": 2},
        "shutdown_timeout": 5.0,
        # Unconfined (the site policy's opt-out): these drills read the trainer's host pids from a
        # file next to it; the confined runs are in test_confinement.py.
        "confinement": {"mode": "off"},
    }
    fields.update(kw)
    return SiteRun(**fields)


def run(trainer, global_model, output, lines, *args, **kw):
    return run_site(
        make_run(trainer, global_model, output, *args, **kw),
        ProcessLauncher(sink=lines),
        handle_signals=False,
    )


def failure(output: pathlib.Path) -> dict:
    return json.loads(failure_path(output).read_text())


def test_success_returns_a_summary(trainer, global_model, output, lines) -> None:
    rc, summary = run(trainer, global_model, output, lines, "ok")
    assert rc is RC.SUCCESS, summary
    assert isinstance(summary, dict)
    data = output.read_bytes()
    assert summary == {
        "site": "site-1",
        "round": 1,
        "task": "train",
        "uri": str(output),
        "sha256": hashlib.sha256(data).hexdigest(),
        "blake3": blake3.blake3(data).hexdigest(),
        "num_samples": 12,
        "params_type": "FULL",
        "metrics": {"loss": 0.25},
    }
    params, _ = read_artifact(output)
    np.testing.assert_array_equal(params["w"], np.full((2, 3), 2.0, np.float32))
    np.testing.assert_array_equal(params["b"], np.full(3, 0.5, np.float32))
    assert not failure_path(output).exists()
    assert read_failure(output) is None
    assert '[site-1 r1] hparams {"epochs": 2, "lr": 0.1}' in lines.lines


def test_evaluate_task_returns_metrics(trainer, global_model, tmp_path, lines) -> None:
    out = tmp_path / "eval.safetensors"
    rc, summary = run(trainer, global_model, out, lines, "evaluate", task="evaluate")
    assert rc is RC.SUCCESS, summary
    assert summary["metrics"] == {"accuracy": 0.875}
    assert summary["task"] == "evaluate"


@pytest.mark.parametrize(("code", "rc"), [(3, RC.EXECUTION_ERROR), (103, RC.CONFIG_ERROR)])
def test_trainer_failure_leaves_a_failure_record_and_no_update(trainer, global_model, output, lines, code, rc) -> None:
    got, reason = run(trainer, global_model, output, lines, "fail", str(code))
    assert got is rc
    assert isinstance(reason, str)
    assert reason.startswith(f"trainer failed: exit code {code}")
    assert failure(output) == {"return_code": int(rc), "name": rc.name, "reason": reason}
    assert read_failure(output) == f"{reason} [{rc.name}]"
    assert not output.exists()
    assert not record_path(output).exists()
    assert "[site-1 r1] about to fail" in lines.lines


def test_trainer_that_sends_nothing(trainer, global_model, output, lines) -> None:
    rc, reason = run(trainer, global_model, output, lines, "nosend")
    assert rc is RC.EXECUTION_ERROR
    assert "the trainer exited successfully but sent no update" in reason
    assert "flare.send()" in reason
    assert failure(output)["reason"] == reason
    assert not output.exists()


@pytest.mark.parametrize(
    ("mode", "fragments"),
    [
        ("shape", ["'w'", "shape (3, 3)", "(2, 3)"]),
        ("nan", ["'w'", "NaN"]),
        ("dtype", ["'w'", "dtype float64", "float32"]),
        ("extra", ["'extra_layer'", "unexpected"]),
        ("missing", ["'b'", "missing"]),
    ],
)
def test_invalid_update_is_removed_and_named(trainer, global_model, output, lines, mode, fragments) -> None:
    rc, reason = run(trainer, global_model, output, lines, mode)
    assert rc is RC.EXECUTION_ERROR
    assert "update from site 'site-1' rejected" in reason
    for fragment in fragments:
        assert fragment in reason, reason
    assert not output.exists(), "an invalid update must not stay where aggregation would find it"
    assert not record_path(output).exists()
    assert failure(output) == {"return_code": 1, "name": "EXECUTION_ERROR", "reason": reason}


def test_rerunning_replaces_the_previous_try_and_nothing_else(trainer, global_model, output, lines) -> None:
    sibling = output.parent / "site-2.safetensors"
    write_artifact(sibling, FLModel(params={"w": np.ones((2, 3), np.float32)}, meta={"num_samples": 1}))
    sibling_bytes = sibling.read_bytes()

    rc, _ = run(trainer, global_model, output, lines, "fail", "1")
    assert rc is RC.EXECUTION_ERROR and failure_path(output).exists()

    rc, summary = run(trainer, global_model, output, lines, "ok")
    assert rc is RC.SUCCESS
    assert not failure_path(output).exists(), "the failure record of the previous try is cleared"
    assert summary["sha256"] == hashlib.sha256(output.read_bytes()).hexdigest()

    # A third try that sends nothing must not be credited with the second try's update.
    rc, reason = run(trainer, global_model, output, lines, "nosend")
    assert rc is RC.EXECUTION_ERROR
    assert "sent no update" in reason
    assert not output.exists() and not record_path(output).exists()

    assert sibling.read_bytes() == sibling_bytes
    assert sorted(p.name for p in output.parent.iterdir()) == [
        "site-1.failure.json",
        "site-2.json",
        "site-2.safetensors",
    ]


def test_missing_executable_is_a_failure_record(global_model, output, lines) -> None:
    rc, reason = run_site(
        SiteRun(
            job="demo",
            run_id="r",
            round=1,
            total_rounds=1,
            site="site-1",
            task="train",
            argv=["/nonexistent/python3", "train.py"],
            global_model=str(global_model),
            output=str(output),
        ),
        ProcessLauncher(sink=lines),
        handle_signals=False,
    )
    assert rc is RC.EXECUTION_ERROR
    assert "cannot start '/nonexistent/python3'" in reason
    assert failure(output)["name"] == "EXECUTION_ERROR"


def test_site_run_json_round_trip(trainer, global_model, output) -> None:
    site_run = make_run(trainer, global_model, output, "ok", launch_timeout=30.0, env={"A": "b"})
    assert SiteRun.from_json(site_run.to_json()) == site_run
    job = site_run.site_job()
    assert job.argv == (PY, str(trainer), "ok")
    assert job.env["A"] == "b"
    assert job.env["FLARE_GLOBAL_MODEL"] == str(global_model)
    assert job.env["FLARE_OUTPUT"] == str(output)
    assert json.loads(job.env["FLARE_HPARAMS"]) == {"lr": 0.1, "epochs": 2}
    assert (job.env["FLARE_ROUND"], job.env["FLARE_TOTAL_ROUNDS"], job.env["FLARE_TASK"]) == ("1", "3", "train")
    assert job.launch_timeout == 30.0


# ---------------------------------------------------------------- the command behind a site task


def runner(site_run: SiteRun | None, extra_env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != SPEC_ENV}
    env.update(extra_env or {})
    if site_run is not None:
        env[SPEC_ENV] = site_run.to_json()
    return subprocess.Popen(
        [PY, "-m", "flare_airflow.site_task"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_runner_command_prints_the_summary_last(trainer, global_model, output) -> None:
    proc = runner(make_run(trainer, global_model, output, "ok"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith(SUMMARY_PREFIX)
    summary = json.loads(last.removeprefix(SUMMARY_PREFIX))
    assert summary["uri"] == str(output)
    assert summary["sha256"] == hashlib.sha256(output.read_bytes()).hexdigest()
    # The spec (which may name secrets' locations) is not passed on to the trainer.
    assert "[site-1 r1] spec visible: False" in out


def test_runner_command_exit_code_is_the_return_code(trainer, global_model, output) -> None:
    proc = runner(make_run(trainer, global_model, output, "fail", "104"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == int(RC.INFRASTRUCTURE_ERROR)
    assert "site site-1 round 1 FAILED [INFRASTRUCTURE_ERROR]: trainer failed: exit code 104" in err
    proc = runner(None)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == int(RC.CONFIG_ERROR)
    assert f"{SPEC_ENV} is not set" in err


HANGER = """
import os, signal, subprocess, sys, time
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, lambda *_: print("got SIGTERM, ignoring it", flush=True))
child = subprocess.Popen(["sleep", "1000"])
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(1000)
"""


def start_hanger(write_script, tmp_path, global_model, output, kill_on_exit, wait, mode, extra_env=None, **kw):
    script = write_script("hanger.py", HANGER)
    pids = tmp_path / "pids"
    site_run = make_run(script, global_model, output, str(pids), mode, **kw)
    proc = runner(site_run, extra_env)
    kill_on_exit(proc.pid)
    assert wait(pids.exists, 30), "the trainer did not start"
    trainer_pid, grandchild = (int(x) for x in pids.read_text().split())
    kill_on_exit(trainer_pid)
    kill_on_exit(grandchild)
    return proc, trainer_pid, grandchild


def test_sigterm_to_the_runner_terminates_the_trainer_group(
    write_script, tmp_path, global_model, output, alive, wait, kill_on_exit
) -> None:
    proc, trainer_pid, grandchild = start_hanger(
        write_script, tmp_path, global_model, output, kill_on_exit, wait, "default"
    )
    assert alive(trainer_pid) and alive(grandchild)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert wait(lambda: not alive(trainer_pid) and not alive(grandchild), 5)
    record = failure(output)
    assert record["name"] == "ABORTED"
    assert record["return_code"] == int(RC.ABORTED)
    assert "site task was killed (SIGTERM)" in record["reason"]
    assert "trainer process group terminated" in err
    assert not output.exists()


def test_sigterm_while_the_launch_timeout_is_being_enforced(
    write_script, tmp_path, global_model, output, alive, wait, kill_on_exit, lines
) -> None:
    """The task is killed while the runner is already terminating a trainer that ignores SIGTERM."""
    proc, trainer_pid, grandchild = start_hanger(
        write_script,
        tmp_path,
        global_model,
        output,
        kill_on_exit,
        wait,
        "ignore-term",
        launch_timeout=0.2,
        shutdown_timeout=2.0,
    )
    reader = threading.Thread(target=lambda: [lines(line) for line in proc.stdout], daemon=True)
    reader.start()
    # The runner sent SIGTERM for the launch timeout and now waits out shutdown_timeout ...
    lines.wait_for("got SIGTERM, ignoring it", timeout=30)
    # ... when the task itself is killed: the runner must still terminate the trainer and exit.
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    reader.join(timeout=10)
    err = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "site task was killed (SIGTERM)" in err
    assert wait(lambda: not alive(trainer_pid) and not alive(grandchild), 5)
    assert failure(output)["name"] == "ABORTED"


# ---------------------------------------------------------------- nothing of a site job outlives it

ESCAPER = """
import os, subprocess, sys, time

pids_file, mode = sys.argv[1], sys.argv[2]
# A grandchild in a session of its own: out of the trainer's process group and session.
setsid_child = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(1000)"])
# A daemon: double fork, setsid, and an empty environment (no trace of the job left in it).
r, w = os.pipe()
first = os.fork()
if first == 0:
    if os.fork() == 0:
        os.setsid()
        os.write(w, str(os.getpid()).encode())
        os.execve("/bin/sleep", ["sleep", "1000"], {})
    os._exit(0)
os.waitpid(first, 0)
daemon = int(os.read(r, 32))
with open(pids_file + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {setsid_child.pid} {daemon}")
os.rename(pids_file + ".tmp", pids_file)
if mode == "fail":
    sys.exit(3)
if mode == "hang":
    time.sleep(1000)
import flare_airflow.client as flare

model = flare.receive()
flare.send(flare.FLModel(params=model.params, meta={"num_samples": 1}))
"""

PARENT = """
import os, subprocess, sys, time
runner = subprocess.Popen([sys.executable, "-m", "flare_airflow.site_task"])
print(runner.pid, flush=True)
time.sleep(1000)
"""


@pytest.mark.parametrize("end", ["success", "failure", "launch-timeout", "sigterm-runner", "sigkill-parent"])
def test_no_descendant_outlives_the_site_job(
    end, write_script, tmp_path, global_model, output, alive, wait, kill_on_exit
) -> None:
    script = write_script("escaper.py", ESCAPER)
    pids = tmp_path / "pids"
    mode = {"success": "ok", "failure": "fail"}.get(end, "hang")
    site_run = make_run(
        script, global_model, output, str(pids), mode, launch_timeout=1.0 if end == "launch-timeout" else None
    )
    parent = None
    if end == "sigkill-parent":
        env = {k: v for k, v in os.environ.items() if k != SPEC_ENV} | {SPEC_ENV: site_run.to_json()}
        parent = subprocess.Popen([PY, write_script("parent.py", PARENT)], env=env, stdout=subprocess.PIPE, text=True)
        kill_on_exit(parent.pid)
        runner_pid = int(parent.stdout.readline())
    else:
        proc = runner(site_run)
        runner_pid = proc.pid
    kill_on_exit(runner_pid)
    assert wait(pids.exists, 30), "the trainer did not start"
    family = [int(x) for x in pids.read_text().split()]
    for pid in family:
        kill_on_exit(pid)
    if end == "sigterm-runner":
        os.kill(runner_pid, signal.SIGTERM)
    elif end == "sigkill-parent":
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        parent.stdout.close()
    if parent is None:
        _, err = proc.communicate(timeout=60)
        expected = {"success": 0, "failure": int(RC.EXECUTION_ERROR), "launch-timeout": int(RC.ABORTED)}
        assert proc.returncode == expected.get(end, 128 + signal.SIGTERM), err
    assert wait(lambda: not alive(runner_pid), 30), "the runner outlived the task process that owned it"
    survivors = [pid for pid in family if alive(pid)]
    assert survivors == [], f"trainer, setsid grandchild, daemon = {family}; still running: {survivors}"
    if end == "success":
        assert output.exists()
    else:
        assert not output.exists() and failure_path(output).exists()


# ---------------------------------------------------------------- checks before the trainer starts


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("remove", "does not exist; re-run the task that published it"),
        ("remove-record", "has no record global.json (never completed)"),
        ("flip-a-byte", "does not match its record"),
        ("truncate", "does not match its record"),
        ("record-not-json", "its record global.json is corrupted (JSONDecodeError)"),
    ],
)
def test_an_unusable_global_model_stops_the_job_before_the_trainer_starts(
    damage, message, trainer, global_model, output, tmp_path, lines
) -> None:
    record = record_path(global_model)
    if damage == "remove":
        global_model.unlink()
    elif damage == "remove-record":
        record.unlink()
    elif damage == "flip-a-byte":
        data = bytearray(global_model.read_bytes())
        data[-1] ^= 0xFF
        global_model.write_bytes(bytes(data))
    elif damage == "truncate":
        global_model.write_bytes(global_model.read_bytes()[:-4])
    else:
        record.write_text("{not json")
    started = tmp_path / "started"
    rc, reason = run(trainer, global_model, output, lines, "fail", "0", argv=[PY, "-c", f"open({str(started)!r}, 'w')"])
    assert rc is RC.INFRASTRUCTURE_ERROR
    assert message in reason and "site site-1 round 1: the input global model" in reason
    assert not started.exists(), "the trainer must not start on an unusable global model"
    assert failure(output)["name"] == "INFRASTRUCTURE_ERROR"
    assert not output.exists()


SECRET_TRAINER = """
import hashlib, os, sys
import flare_airflow.client as flare
model = flare.receive()
print("runner spec or secrets visible:", any(k.startswith("FLARE_SITE_") for k in os.environ), flush=True)
digest = hashlib.sha256(os.environ["API_TOKEN"].encode()).hexdigest()
metrics = {"token_sha_prefix": int(digest[:8], 16)}
flare.send(flare.FLModel(params=model.params, meta={"num_samples": 1}, metrics=metrics))
"""


def test_secrets_reach_the_trainer_environment_only(write_script, global_model, output) -> None:
    import hashlib

    from flare_airflow.site_task.spec import SECRETS_ENV

    canary = "canary-" + os.urandom(8).hex()
    site_run = make_run(write_script("secret.py", SECRET_TRAINER), global_model, output)
    assert canary not in site_run.to_json()
    env = {k: v for k, v in os.environ.items() if k != SPEC_ENV} | {
        SPEC_ENV: site_run.to_json(),
        SECRETS_ENV: json.dumps({"API_TOKEN": canary}),
    }
    proc = subprocess.Popen(
        [PY, "-m", "flare_airflow.site_task"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = json.loads(out.decode().strip().splitlines()[-1].removeprefix(SUMMARY_PREFIX))
    assert summary["metrics"]["token_sha_prefix"] == int(hashlib.sha256(canary.encode()).hexdigest()[:8], 16)
    assert b"runner spec or secrets visible: False" in out
    assert canary.encode() not in out + err


def test_a_failure_reason_never_repeats_a_secret(write_script, global_model, output, lines) -> None:
    script = write_script("leak.py", "import os, sys\nprint('token:', os.environ['API_TOKEN'])\nsys.exit(2)\n")
    rc, reason = run_site(
        make_run(script, global_model, output),
        ProcessLauncher(sink=lines),
        handle_signals=False,
        secrets={"API_TOKEN": "hunter2-canary"},
    )
    assert rc is RC.EXECUTION_ERROR
    assert reason == "trainer failed: exit code 2; its last output: token: ***"
    assert "hunter2-canary" not in failure_path(output).read_text()


@pytest.mark.parametrize(
    "tamper",
    [
        # in place, same size: only the mtime tells (the fingerprint), the hash confirms
        "p = os.environ['FLARE_GLOBAL_MODEL']; b = bytearray(open(p, 'rb').read()); b[-1] ^= 1; open(p, 'wb').write(b)",
        # replaced by another file (new inode) with the same bytes: hashed again, found intact
        "import shutil; p = os.environ['FLARE_GLOBAL_MODEL']; shutil.copy(p, p + '.x'); os.replace(p + '.x', p)",
    ],
    ids=["bit-flip-in-place", "same-bytes-new-inode"],
)
def test_a_trainer_that_touches_its_input_global_model(tamper: str, tmp_path: pathlib.Path) -> None:
    store = tmp_path / "store"
    global_model = store / "round-0000" / "global.safetensors"
    write_artifact(global_model, FLModel(params={"w": np.ones(3, np.float32)}))
    script = tmp_path / "tamper.py"
    script.write_text(
        "import os\nimport flare_airflow.client as flare\nm = flare.receive()\n"
        f"{tamper}\n"
        "flare.send(flare.FLModel(params=m.params, meta={'num_samples': 1}))\n"
    )
    run = SiteRun(
        job="demo", run_id="r", round=1, total_rounds=1, site="site-1", task="train",
        argv=[sys.executable, str(script)], global_model=str(global_model),
        output=str(store / "round-0001" / "sites" / "site-1.safetensors"),
        staging=str(store / "round-0001" / "staging" / "site-1" / "try-1" / "update.safetensors"),
        shutdown_timeout=2.0, confinement={"mode": "off"},  # unconfined: the trainer can write its input
    )  # fmt: skip
    rc, result = run_site(run, ProcessLauncher(sink=lambda _line: None), handle_signals=False)
    if "^=" in tamper:
        assert rc is RC.EXECUTION_ERROR
        assert "the trainer changed or removed its input global model" in str(result)
        assert not (store / "round-0001" / "sites" / "site-1.safetensors").exists()
    else:
        assert rc is RC.SUCCESS, result


def test_a_killed_runner_removes_the_task_result_file(
    write_script, tmp_path, global_model, output, alive, wait, kill_on_exit
) -> None:
    """The task process that made the file died with kill -9: nobody else would remove it."""
    from flare_airflow.site_task.spec import RESULT_FILE_ENV

    result_file = tmp_path / "flare-site-result-x"
    result_file.write_text("")
    proc, trainer_pid, _ = start_hanger(
        write_script, tmp_path, global_model, output, kill_on_exit, wait, "default",
        extra_env={RESULT_FILE_ENV: str(result_file)},
    )  # fmt: skip
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not result_file.exists()
    assert wait(lambda: not alive(trainer_pid), 5)


def test_the_site_signs_its_update_record_and_without_its_key_publishes_nothing(
    trainer, global_model, output, lines, tmp_path
) -> None:
    from flare_airflow.core.trust import Registry, verify_record
    from flare_airflow.core.trust.records import trainer_digest

    trust = {"key_dir": str(tmp_path / "keys"), "registry_path": None}
    rc, summary = run(trainer, global_model, output, lines, "ok", try_number=2, trust=trust)
    assert rc is RC.SUCCESS and isinstance(summary, dict), summary
    payload = verify_record(
        summary["signed"], Registry.from_key_dir(tmp_path / "keys"), party="site-1", expect={}, what="update"
    )
    assert payload == {
        "type": "update", "job": "demo", "run_id": "manual__2024-01-01T00:00:00+00:00", "round": 1, "site": "site-1",
        "try": 2, "size": output.stat().st_size, "sha256": summary["sha256"], "blake3": summary["blake3"],
        "num_samples": 12, "params_type": "FULL", "privacy": None,
        "trainer": trainer_digest([PY, str(trainer), "ok"]),
    }  # fmt: skip
    # Strict mode on a worker that never made its key: the update is refused, nothing published.
    (tmp_path / "registry.json").write_text('{"keys": []}')
    strict = {"key_dir": str(tmp_path / "none"), "registry_path": str(tmp_path / "registry.json")}
    rc, reason = run(trainer, global_model, output, lines, "ok", trust=strict)
    assert rc is RC.EXECUTION_ERROR and "flare-airflow site keygen site-1" in str(reason)
    assert not output.exists() and "no signing key" in failure(output)["reason"]


def lora_block(base: pathlib.Path, sha256: str) -> dict:
    return {
        "base_model": str(base),
        "base_model_sha256": sha256,
        "target_modules": ["q_proj"],
        "rank": 2,
        "alpha": 4.0,
        "seq_len": 16,
        "steps_per_round": 1,
        "frozen": [],
    }


def test_a_lora_site_whose_base_model_matches_trains_and_sees_its_block(
    trainer, global_model, output, lines, tmp_path
) -> None:
    base = tmp_path / "base.gguf"
    base.write_bytes(b"weights of the base model")
    lora = lora_block(base, hashlib.sha256(base.read_bytes()).hexdigest())
    rc, summary = run(trainer, global_model, output, lines, "ok", lora=lora)
    assert rc is RC.SUCCESS, summary
    assert make_run(trainer, global_model, output, lora=lora).site_job().env["FLARE_LORA"] == json.dumps(lora)


@pytest.mark.parametrize("damage", ["other", "missing"])
def test_a_lora_site_with_another_base_model_is_refused_before_training(
    trainer, global_model, output, lines, tmp_path, damage
) -> None:
    base = tmp_path / "base.gguf"
    if damage == "other":
        base.write_bytes(b"a different base model")
    rc, reason = run(trainer, global_model, output, lines, "ok", lora=lora_block(base, "ab" * 32))
    assert rc is RC.CONFIG_ERROR
    fragment = "but the job pins abababababababab" if damage == "other" else "cannot be read"
    assert fragment in reason and "the trainer was not started" in reason and str(base) in reason
    assert not any("hparams" in line for line in lines.lines)  # the trainer never ran
    assert failure(output)["reason"] == reason and not output.exists()
