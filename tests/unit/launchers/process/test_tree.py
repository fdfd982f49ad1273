"""Every process of a job ends with it: its group, its stray children, processes that left the group,
and the trainer when its launcher dies (flare_airflow.launchers.process.tree, through the handle)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobState
from flare_airflow.launchers.process import ProcessLauncher
from tests.unit.launchers.process.jobs import PY, RC, site_job

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
