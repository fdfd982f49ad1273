"""The process launcher: exact argv, streamed output, process-group termination, exit-code mapping."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode, JobState, SiteJob
from flare_airflow.launchers.process import LaunchError, ProcessLauncher, map_exit, trainer_environment

PY = sys.executable
RC = JobReturnCode


def site_job(argv: list[str], **kw) -> SiteJob:
    return SiteJob(job="demo", run_id="run-1", round=2, site="site-1", argv=tuple(argv), **kw)


# ---------------------------------------------------------------- the exit-status table


@pytest.mark.parametrize(
    ("code", "terminated", "state", "rc", "reason"),
    [
        (None, False, JobState.RUNNING, RC.UNKNOWN, ""),
        (0, False, JobState.SUCCEEDED, RC.SUCCESS, ""),
        (1, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 1"),
        (2, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 2"),
        (9, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 9"),  # exit 9 is not ABORTED
        (101, False, JobState.FAILED, RC.EXCEPTION, "exit code 101 (EXCEPTION)"),
        (102, False, JobState.FAILED, RC.UNSAFE_COMPONENT, "exit code 102 (UNSAFE_COMPONENT)"),
        (103, False, JobState.FAILED, RC.CONFIG_ERROR, "exit code 103 (CONFIG_ERROR)"),
        (104, False, JobState.FAILED, RC.INFRASTRUCTURE_ERROR, "exit code 104 (INFRASTRUCTURE_ERROR)"),
        (127, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 127"),  # never UNKNOWN ("running")
        (255, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 255"),
        (-signal.SIGTERM, True, JobState.TERMINATED, RC.ABORTED, "terminated (SIGTERM)"),
        (-signal.SIGKILL, True, JobState.TERMINATED, RC.ABORTED, "terminated (SIGKILL)"),
        (3, True, JobState.TERMINATED, RC.ABORTED, "terminated (exit code 3)"),
        (0, True, JobState.TERMINATED, RC.ABORTED, "terminated (exit code 0)"),  # stopped early: not a success
        (
            -signal.SIGKILL,
            False,
            JobState.FAILED,
            RC.EXECUTION_ERROR,
            "killed by SIGKILL (possibly the out-of-memory killer)",
        ),
        (-signal.SIGSEGV, False, JobState.FAILED, RC.EXECUTION_ERROR, "killed by SIGSEGV"),
        (-signal.SIGTERM, False, JobState.FAILED, RC.EXECUTION_ERROR, "killed by SIGTERM"),
        (-200, False, JobState.FAILED, RC.EXECUTION_ERROR, "killed by signal 200"),
    ],
)
def test_map_exit(code, terminated, state, rc, reason) -> None:
    assert map_exit(code, terminated=terminated) == (state, rc, reason)


@pytest.mark.parametrize(
    ("code", "rc"), [(0, RC.SUCCESS), (1, RC.EXECUTION_ERROR), (103, RC.CONFIG_ERROR), (127, RC.EXECUTION_ERROR)]
)
def test_real_exit_codes(code, rc, lines) -> None:
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, "-c", f"import sys; sys.exit({code})"]))
    assert handle.wait(timeout=30) is rc
    assert handle.poll() is rc
    assert handle.state is (JobState.SUCCEEDED if code == 0 else JobState.FAILED)
    assert handle.reason == ("" if code == 0 else map_exit(code, terminated=False)[2])


def test_a_trainer_killed_by_a_signal_it_did_not_get_from_us(lines) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, "-c", code]))
    assert handle.wait(timeout=30) is RC.EXECUTION_ERROR
    assert handle.state is JobState.FAILED
    assert handle.reason == "killed by SIGKILL (possibly the out-of-memory killer)"


# ---------------------------------------------------------------- argv is exact, never a shell

HOSTILE = [
    "$(touch {tmp}/pwned-subshell)",
    "`touch {tmp}/pwned-backtick`",
    "; touch {tmp}/pwned-semicolon",
    "; rm -rf victim",
    "&& rm -rf victim",
    "| tee {tmp}/pwned-pipe",
    "> {tmp}/pwned-redirect",
    "*",
    "victim/*",
    "~",
    "$HOME",
    "'\"",
    "it's",
    "{{{{ ds }}}}",
    "line one\nline two",
    "",
    " leading and trailing ",
    "--flag=$(id)",
]


def test_argv_with_shell_metacharacters_arrives_literally(write_script, tmp_path, lines) -> None:
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep.txt").write_text("still here")
    dump = write_script("dump_argv.py", "import json, sys\njson.dump(sys.argv[2:], open(sys.argv[1], 'w'))\n")
    out = tmp_path / "argv.json"
    args = [a.format(tmp=tmp_path) for a in HOSTILE]
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, str(dump), str(out), *args], cwd=str(tmp_path)))
    assert handle.wait(timeout=30) is RC.SUCCESS
    assert json.loads(out.read_text()) == args
    assert "{{ ds }}" in args and "$(touch" in args[0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("pwned")) == []
    assert (tmp_path / "victim" / "keep.txt").read_text() == "still here"


# ---------------------------------------------------------------- output


def test_output_streams_line_by_line_in_order_with_a_prefix(write_script, tmp_path, lines) -> None:
    go = tmp_path / "go"
    script = write_script(
        "talk.py",
        f"""
        import os, sys, time
        print("first")
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        for i in range(20):
            print(f"line {{i}}")
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
        """,
    )
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, str(script)]))
    # "first" arrives while the trainer still runs: output is streamed, not collected at exit.
    lines.wait_for("first")
    assert handle.poll() is RC.UNKNOWN
    go.touch()
    assert handle.wait(timeout=30) is RC.SUCCESS
    assert lines.lines == [
        "[site-1 r2] first",
        *(f"[site-1 r2] line {i}" for i in range(20)),
        "[site-1 r2] to stderr",
        "[site-1 r2] no newline at the end",
    ]


def test_prefix_can_be_turned_off(lines) -> None:
    handle = ProcessLauncher(sink=lines, prefix_lines=False).launch_job(site_job([PY, "-c", "print('plain')"]))
    assert handle.wait(timeout=30) is RC.SUCCESS
    assert lines.lines == ["plain"]


# ---------------------------------------------------------------- termination

SPAWNER = """
import os, signal, subprocess, sys, time
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "1000"])
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
print("ready", flush=True)
if sys.argv[3] == "stay":
    time.sleep(1000)
"""


def spawn(write_script, tmp_path, lines, kill_on_exit, mode: str, stay: str, **kw):
    script = write_script("spawner.py", SPAWNER)
    pids = tmp_path / "pids"
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, str(script), str(pids), mode, stay], **kw))
    kill_on_exit(handle.pid)
    lines.wait_for("ready")
    trainer, grandchild = (int(x) for x in pids.read_text().split())
    kill_on_exit(grandchild)
    assert trainer == handle.pid
    return handle, trainer, grandchild


def test_terminate_reaches_the_whole_process_group(write_script, tmp_path, lines, alive, wait, kill_on_exit) -> None:
    handle, trainer, grandchild = spawn(write_script, tmp_path, lines, kill_on_exit, "default", "stay")
    assert alive(trainer) and alive(grandchild)
    assert handle.state is JobState.RUNNING
    started = time.monotonic()
    handle.terminate()
    assert time.monotonic() - started < 5, "SIGTERM should have been enough"
    assert not alive(trainer)
    assert wait(lambda: not alive(grandchild), 5), "the grandchild `sleep 1000` survived terminate()"
    assert handle.poll() is RC.ABORTED
    assert handle.wait(timeout=1) is RC.ABORTED
    assert handle.state is JobState.TERMINATED
    assert handle.reason == "terminated (SIGTERM)"
    handle.terminate()  # idempotent


def test_sigkill_after_shutdown_timeout_when_sigterm_is_ignored(
    write_script, tmp_path, lines, alive, wait, kill_on_exit
) -> None:
    handle, trainer, grandchild = spawn(
        write_script, tmp_path, lines, kill_on_exit, "ignore-term", "stay", shutdown_timeout=0.5
    )
    started = time.monotonic()
    handle.terminate()
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 5
    assert not alive(trainer)
    assert wait(lambda: not alive(grandchild), 5)
    assert handle.poll() is RC.ABORTED
    assert handle.reason == "terminated (SIGKILL)"


def test_stray_children_are_killed_after_a_normal_exit(
    write_script, tmp_path, lines, alive, wait, kill_on_exit
) -> None:
    # The grandchild inherits the output pipe too: wait() must not hang on it.
    handle, trainer, grandchild = spawn(write_script, tmp_path, lines, kill_on_exit, "default", "leave")
    started = time.monotonic()
    assert handle.wait(timeout=30) is RC.SUCCESS
    assert time.monotonic() - started < 10
    assert not alive(trainer)
    assert wait(lambda: not alive(grandchild), 5), "the stray `sleep 1000` outlived its trainer"
    assert handle.state is JobState.SUCCEEDED


def test_wait_with_a_timeout_returns_unknown_while_running(lines, kill_on_exit) -> None:
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, "-c", "import time; time.sleep(1000)"]))
    kill_on_exit(handle.pid)
    started = time.monotonic()
    assert handle.wait(timeout=0.3) is RC.UNKNOWN
    assert 0.3 <= time.monotonic() - started < 5
    assert handle.poll() is RC.UNKNOWN
    assert handle.state is JobState.RUNNING
    assert handle.reason == ""
    handle.terminate()
    assert handle.wait(timeout=5) is RC.ABORTED


def test_terminate_from_another_thread_ends_a_wait_blocked_in_waitpid(lines, kill_on_exit) -> None:
    # wait() without a timeout blocks in waitpid; an operator's on_kill terminates from another thread.
    handle = ProcessLauncher(sink=lines).launch_job(
        site_job([PY, "-c", "import time; time.sleep(1000)"], shutdown_timeout=5)
    )
    kill_on_exit(handle.pid)
    outcome: list[RC] = []
    waiter = threading.Thread(target=lambda: outcome.append(handle.wait()))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not outcome
    started = time.monotonic()
    handle.terminate()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "wait() stayed blocked after terminate()"
    assert time.monotonic() - started < 5
    assert outcome == [RC.ABORTED]
    assert handle.reason == "terminated (SIGTERM)"


def test_launch_timeout_terminates_a_trainer_that_never_calls_receive(lines, alive, kill_on_exit) -> None:
    job = site_job([PY, "-c", "import time; time.sleep(1000)"], launch_timeout=0.5, shutdown_timeout=5)
    handle = ProcessLauncher(sink=lines).launch_job(job)
    kill_on_exit(handle.pid)
    started = time.monotonic()
    assert handle.wait(timeout=30) is RC.ABORTED
    assert 0.5 <= time.monotonic() - started < 10
    assert not alive(handle.pid)
    assert handle.state is JobState.TERMINATED
    assert "did not call receive() within launch_timeout=0.5s" in handle.reason


def test_launch_timeout_spares_a_trainer_that_called_receive(write_script, tmp_path, lines, kill_on_exit) -> None:
    model = tmp_path / "global.safetensors"
    write_artifact(model, FLModel(params={"w": np.zeros(2)}))
    go = tmp_path / "go"
    script = write_script(
        "slow.py",
        f"""
        import os, time
        import flare_airflow.client as flare
        flare.receive()
        print("received", os.environ["FLARE_HANDSHAKE"], flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        """,
    )
    env = {
        "FLARE_JOB": "demo",
        "FLARE_RUN_ID": "run-1",
        "FLARE_SITE": "site-1",
        "FLARE_ROUND": "2",
        "FLARE_TOTAL_ROUNDS": "3",
        "FLARE_TASK": "train",
        "FLARE_GLOBAL_MODEL": str(model),
        "FLARE_OUTPUT": str(tmp_path / "out.safetensors"),
    }
    job = site_job([PY, str(script)], env=env, launch_timeout=0.3)
    started = time.monotonic()
    handle = ProcessLauncher(sink=lines).launch_job(job)
    kill_on_exit(handle.pid)
    handshake = pathlib.Path(lines.wait_for("received").split()[-1])
    assert handshake.exists()
    while time.monotonic() - started < 0.6:  # polled past the launch timeout
        assert handle.poll() is RC.UNKNOWN
        time.sleep(0.05)
    go.touch()
    assert handle.wait(timeout=30) is RC.SUCCESS
    assert not handshake.exists(), "the handshake file is cleaned up"


# ---------------------------------------------------------------- launch errors and environment


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


# ---------------------------------------------------------------- the trainer dies with its launcher

HELPER = """
import sys, time
from flare_airflow.core.spec import SiteJob
from flare_airflow.launchers.process import ProcessLauncher

argv = (sys.executable, "-c", "import time; time.sleep(1000)")
job = SiteJob(job="demo", run_id="r", round=1, site="site-1", argv=argv)
handle = ProcessLauncher(sink=lambda line: None).launch_job(job)
print(handle.pid, flush=True)
time.sleep(1000)
"""


def test_trainer_dies_when_its_launcher_is_sigkilled(write_script, alive, wait, kill_on_exit) -> None:
    helper_script = write_script("helper.py", HELPER)
    helper = subprocess.Popen([PY, str(helper_script)], stdout=subprocess.PIPE, text=True)
    kill_on_exit(helper.pid)
    try:
        trainer = int(helper.stdout.readline())
        kill_on_exit(trainer)
        assert alive(trainer)
        # The trainer has its own session: only PR_SET_PDEATHSIG can take it down with the helper.
        assert os.getsid(trainer) == trainer != os.getsid(helper.pid)
        os.kill(helper.pid, signal.SIGKILL)
        helper.wait(timeout=10)
        assert wait(lambda: not alive(trainer), 5), "the trainer outlived its SIGKILLed launcher"
    finally:
        helper.stdout.close()


# ---------------------------------------------------------------- the whole tree, not just the group

ESCAPES = """
import os, subprocess, sys, time
# A grandchild in a session of its own, and a double-forked daemon: both leave the trainer's group.
setsid_child = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(1000)"])
r, w = os.pipe()
first = os.fork()
if first == 0:
    if os.fork() == 0:
        os.setsid()
        os.write(w, str(os.getpid()).encode())
        os.execv("/bin/sleep", ["sleep", "1000"])
    os._exit(0)
os.waitpid(first, 0)
daemon = os.read(r, 32).decode()
while os.getsid(setsid_child.pid) != setsid_child.pid:
    time.sleep(0.01)
with open(sys.argv[1], "w") as fh:
    fh.write(f"{setsid_child.pid} {daemon}")
print("ready", flush=True)
if sys.argv[2] == "stay":
    time.sleep(1000)
"""


@pytest.mark.parametrize("end", ["terminate", "exit"])
def test_processes_that_left_the_group_end_with_the_job(
    end, write_script, tmp_path, lines, alive, wait, kill_on_exit
) -> None:
    bystander = subprocess.Popen(["sleep", "1000"])  # started by us, not by the job: must survive
    kill_on_exit(bystander.pid)
    pids = tmp_path / "pids"
    script = write_script("escapes.py", ESCAPES)
    handle = ProcessLauncher(sink=lines).launch_job(
        site_job([PY, str(script), str(pids), "stay" if end == "terminate" else "leave"], shutdown_timeout=5)
    )
    kill_on_exit(handle.pid)
    lines.wait_for("ready")
    escaped = [int(x) for x in pids.read_text().split()]
    for pid in escaped:
        kill_on_exit(pid)
    assert len(escaped) == 2
    started = time.monotonic()
    if end == "terminate":
        handle.terminate()
    else:
        assert handle.wait(timeout=30) is RC.SUCCESS
    assert time.monotonic() - started < 4, "SIGTERM should have been enough"
    assert wait(lambda: not any(alive(pid) for pid in escaped), 5), [p for p in escaped if alive(p)]
    assert alive(bystander.pid)
    bystander.kill()
    bystander.wait()


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


def test_a_failure_reason_quotes_the_last_output_line_with_secrets_hidden(lines) -> None:
    code = "print('token is s3cr3t'); raise SystemExit('ValueError: bad learning rate')"
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, "-c", code], env={"TOKEN": "s3cr3t"}))
    handle.hide(["s3cr3t"])
    assert handle.wait(timeout=30) is RC.EXECUTION_ERROR
    assert handle.reason == "exit code 1; its last output: ValueError: bad learning rate"
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, "-c", "print('key s3cr3t'); raise SystemExit(2)"]))
    handle.hide(["s3cr3t"])
    assert handle.wait(timeout=30) is RC.EXECUTION_ERROR
    assert handle.reason == "exit code 2; its last output: key ***"
