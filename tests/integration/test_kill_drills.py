"""Kill drills on Airflow's real scheduler (LocalExecutor, PostgreSQL): ``kill -9`` of a site
task's process, or of the supervisor that runs it, mid-round.

The FedAdam drills (issue 25) kill the aggregation task itself, and fail a round to resume it:
the server state and every round's model must come out as an uninterrupted FedAdam run's.

Each site drill runs the same job as an uninterrupted run (3 process sites x 3 rounds, quorum 2,
one retry, one GPU each from a 3-GPU host) and asserts: the killed try's site runner and trainer
end within seconds, the task is retried and succeeds, every task instance succeeds, no GPU lease
is left held, the final model is the uninterrupted run's bit for bit, and no process of the run
is left (the orphan audit after every test).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from safetensors.numpy import load_file

from flare_airflow.builder import AGGREGATE_TASK
from flare_airflow.core.model import read_record
from flare_airflow_testing.harness import TRAINERS, tiny_model
from flare_airflow_testing.stack import (
    BIN,
    HEARTBEAT_DRILL_ENV,
    AirflowStack,
    Postgres,
    alive,
    kill9,
    parent_of,
    scheduler_stack,
    site_processes,
    wait_gone,
)

JOB = "killdrill"
DAG = f"flare_{JOB}"
ROUNDS = 3
SITES = ("site-1", "site-2", "site-3")
TRAIN_SECONDS = 3
VICTIM_SITE, VICTIM_ROUND = "site-2", 2
# How long the killed try's runner and trainer may outlive the kill: the runner polls its
# owners every 0.5 s and ends the trainer with SIGTERM (SIGKILL after shutdown_timeout, 2 s).
ORPHAN_LIMIT_SECONDS = 5.0

# The victim site job "trains" longer than ORPHAN_LIMIT_SECONDS: a killed try's trainer that
# lived on would still be running when the drill looks, instead of having finished by itself.
VICTIM_TRAIN_SECONDS = 10
SLOW_TRAINER = """
import os, runpy, sys, time
seconds, victim_site, victim_round, victim_seconds = sys.argv[1:5]
if (os.environ["FLARE_SITE"], os.environ["FLARE_ROUND"]) == (victim_site, victim_round):
    seconds = victim_seconds
time.sleep(float(seconds))
sys.argv = [{behave!r}, *sys.argv[5:]]
runpy.run_path({behave!r}, run_name="__main__")
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: Postgres) -> Iterator[AirflowStack]:
    root = tmp_path_factory.mktemp("drills")
    # A killed supervisor stops heartbeating: the scheduler fails its try after 12 s.
    env = {"FLARE_GPU_LOCK_DIR": str(root / "gpu-locks"), **HEARTBEAT_DRILL_ENV}
    with scheduler_stack(root, env, postgres=postgres, start=False, parallelism=6) as airflow:
        write_job(airflow, root / "store")
        write_fedadam_job(airflow, root / "store", root / "site-2-may-run")
        # The GPU pool is synced while the components start: no task is queued before a run is triggered.
        synced = subprocess.Popen(
            [str(BIN / "flare-airflow"), "pools", "sync", str(airflow.dags / JOB / "job.yaml")],
            env=airflow.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            airflow.start()
        finally:
            output, _ = synced.communicate(timeout=120)
        assert synced.returncode == 0, output
        yield airflow


def write_job(stack: AirflowStack, store: pathlib.Path) -> None:
    folder = stack.dags / JOB
    folder.mkdir()
    trainer = folder / "slow.py"
    trainer.write_text(SLOW_TRAINER.format(behave=str(TRAINERS / "behave.py")))
    manager = {"type": "gpu", "num_of_gpus": 3, "pool": "flare_gpu_drill"}
    job = {
        "job": JOB,
        "rounds": ROUNDS,
        "min_clients": 2,
        "store": str(store),
        "initial_model": str(tiny_model(folder / "init.safetensors")),
        "trainer": {
            "script": str(trainer),
            "args": [str(TRAIN_SECONDS), VICTIM_SITE, str(VICTIM_ROUND), str(VICTIM_TRAIN_SECONDS)],
            "shutdown_timeout": 2,
        },
        "evaluate": False,
        "sites": {
            "@default": {
                "retries": 1,
                "retry_delay_seconds": 1,
                "resource_spec": {"num_of_gpus": 1},
                "resource_manager": manager,
            },
            **{site: {} for site in SITES},
        },
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    (folder / "dag.py").write_text(
        textwrap.dedent(
            """
            from pathlib import Path
            from flare_airflow.builder import build_dag
            dag = build_dag(Path(__file__).with_name("job.yaml"))
            """
        )
    )


def store_root(stack: AirflowStack) -> pathlib.Path:
    return stack.root.parent / "store"


def xcom(stack: AirflowStack, run_id: str, task_id: str) -> dict[str, Any]:
    body = stack.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value")
    value = body["value"]
    return dict(json.loads(value) if isinstance(value, str) else value)


def tensors_sha256(path: str) -> str:
    """sha256 over the tensors (name, dtype, shape, bytes): the final model file's own metadata
    names its run, so two runs' files differ in that alone."""
    digest = hashlib.sha256()
    for name, array in sorted(load_file(path.removeprefix("file://")).items()):
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def file_sha256(uri: str) -> str:
    return hashlib.sha256(pathlib.Path(uri.removeprefix("file://")).read_bytes()).hexdigest()


def outcome(stack: AirflowStack, run_id: str) -> dict[str, Any]:
    """Final states, the final model's tensor digest and the last round's global model file digest."""
    tis = stack.task_instances(DAG, run_id)
    last = xcom(stack, run_id, f"round_{ROUNDS}.{AGGREGATE_TASK}")
    published = xcom(stack, run_id, "publish")
    return {
        "states": {t: ti["state"] for t, ti in tis.items()},
        "tries": {t: ti["try_number"] for t, ti in tis.items()},
        "accepted": {r: xcom(stack, run_id, f"round_{r}.{AGGREGATE_TASK}")["accepted"] for r in range(1, ROUNDS + 1)},
        "final": tensors_sha256(published["final_model"]),
        "global": file_sha256(last["global_uri"]),
    }


def held_gpu_leases(lock_dir: pathlib.Path) -> list[str]:
    """GPU lock files some process still holds (a lease is an flock on the GPU's file)."""
    held = []
    for path in sorted(lock_dir.glob("*")) if lock_dir.exists() else []:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(path.name)
        finally:
            os.close(fd)
    return held


@pytest.fixture(scope="module")
def uninterrupted_runs(stack: AirflowStack) -> dict[str, str]:
    """The reference runs of both jobs, triggered together (they share no task, pool or store
    path): ``{dag_id: run_id}`` once both have ended. Each drill's run is compared with its job's."""
    (stack.root.parent / "site-2-may-run").touch()
    runs = {dag_id: stack.trigger(dag_id) for dag_id in (DAG, FEDADAM_DAG)}
    for dag_id, run_id in runs.items():
        assert stack.wait_for_run(dag_id, run_id, timeout=300) == "success", dag_id
    return runs


@pytest.fixture(scope="module")
def baseline(stack: AirflowStack, uninterrupted_runs: dict[str, str]) -> dict[str, Any]:
    result = outcome(stack, uninterrupted_runs[DAG])
    assert set(result["states"].values()) == {"success"}, result["states"]
    assert all(sites == list(SITES) for sites in result["accepted"].values())
    return result


@pytest.fixture(autouse=True)
def orphan_audit(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every drill: no site runner or trainer of this stack's runs is left, no GPU lease held."""
    yield
    if "stack" not in request.fixturenames:
        return
    stack: AirflowStack = request.getfixturevalue("stack")
    deadline = time.monotonic() + ORPHAN_LIMIT_SECONDS
    while (left := site_processes(str(store_root(stack)))) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        kill9(pid)
    assert left == {}, f"processes of the drill's runs still running: {left}"
    assert held_gpu_leases(pathlib.Path(stack.env["FLARE_GPU_LOCK_DIR"])) == []


def find_victim(stack: AirflowStack, run_id: str, timeout: float = 180) -> tuple[int, list[int]]:
    """The runner and trainer(s) of the victim site's first try, once its trainer runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = site_processes(run_id)
        ours = {p: i for p, i in procs.items() if (i["site"], i["round"]) == (VICTIM_SITE, VICTIM_ROUND)}
        runners = [p for p, i in ours.items() if i["kind"] == "runner"]
        trainers = [p for p, i in ours.items() if i["kind"] == "trainer"]
        if runners and trainers:
            return runners[0], trainers
        time.sleep(0.1)
    raise AssertionError(f"{VICTIM_SITE} round {VICTIM_ROUND} never started a trainer in run {run_id}")


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().replace(b"\0", b" ").decode(errors="replace")
    return ""


def drill(stack: AirflowStack, baseline: dict[str, Any], victim: str) -> dict[str, Any]:
    run_id = stack.trigger(DAG)
    runner, trainers = find_victim(stack, run_id)
    task_process = parent_of(runner)
    assert task_process is not None
    supervisor = parent_of(task_process)
    assert supervisor is not None and "airflow" in cmdline(supervisor), cmdline(supervisor)
    assert os.getpgid(task_process) == task_process, "the task process leads its own process group"
    target = task_process if victim == "task process" else supervisor
    kill9(target)
    ended = wait_gone([runner, *trainers], timeout=30)
    assert ended is not None and ended < ORPHAN_LIMIT_SECONDS, (
        f"the killed try's site runner/trainer outlived the {victim} by {ended or '>30'} s"
    )

    assert stack.wait_for_run(DAG, run_id, timeout=240) == "success"
    result = outcome(stack, run_id)
    victim_task = f"round_{VICTIM_ROUND}.{VICTIM_SITE}"
    assert set(result["states"].values()) == {"success"}, result["states"]
    assert result["tries"][victim_task] == 2, "the killed try was retried"
    tries = stack.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/{victim_task}/tries")["task_instances"]
    assert [t["state"] for t in sorted(tries, key=lambda t: t["try_number"])] == ["failed", "success"]
    assert all(sites == list(SITES) for sites in result["accepted"].values()), result["accepted"]
    assert (result["final"], result["global"]) == (baseline["final"], baseline["global"])

    # The published update is the one the retry returned, and nothing of the killed try replaced it.
    summary = xcom(stack, run_id, victim_task)
    published = pathlib.Path(summary["uri"].removeprefix("file://"))
    assert read_record(published).sha256 == summary["sha256"]
    staging = published.parent.parent / "staging" / VICTIM_SITE
    assert sorted(p.name for p in staging.glob("try-*")) == ["try-1", "try-2"]
    return {"run_id": run_id, "orphans_ended_after": ended, "task_process": task_process}


def test_killed_task_process_ends_its_site_job_and_the_retry_counts(
    stack: AirflowStack, baseline: dict[str, Any]
) -> None:
    report = drill(stack, baseline, "task process")
    print(f"task process killed: runner and trainer gone after {report['orphans_ended_after']:.2f} s")


def test_killed_supervisor_ends_its_site_job_and_the_retry_counts(
    stack: AirflowStack, baseline: dict[str, Any]
) -> None:
    report = drill(stack, baseline, "supervisor")
    print(f"supervisor killed: runner and trainer gone after {report['orphans_ended_after']:.2f} s")
    # The orphaned task process (Airflow's, not ours) ends once its runner has: it cannot report.
    assert not alive(report["task_process"]), cmdline(report["task_process"])


LATE_TRAINER = """
import os, sys, time
import flare_airflow.client as flare
model = flare.receive()
while not os.path.exists(sys.argv[1]):  # held here until the test lets this try finish
    time.sleep(0.05)
step = float(sys.argv[2])
flare.send(flare.FLModel(params={k: v + step for k, v in model.params.items()}, meta={"num_samples": 1}))
"""


def test_a_late_try_never_replaces_the_update_of_the_try_after_it(tmp_path: pathlib.Path) -> None:
    """Try 1's runner lives on (its owner watch could not stop it: none is given) while try 2 runs
    and publishes; when try 1's trainer finally sends, try 1 publishes nothing."""
    import numpy as np

    from flare_airflow.core.model import FLModel, write_artifact
    from flare_airflow.core.spec import JobReturnCode
    from flare_airflow.launchers.process import ProcessLauncher
    from flare_airflow.site_task.runner import run_site
    from flare_airflow.site_task.spec import SPEC_ENV, SiteRun

    run_dir = tmp_path / "store" / "late" / "run"
    global_model = run_dir / "round-0000" / "global.safetensors"
    write_artifact(global_model, FLModel(params={"w": np.zeros(4, np.float32)}))
    trainer = tmp_path / "late.py"
    trainer.write_text(LATE_TRAINER)
    output = run_dir / "round-0001" / "sites" / "site-1.safetensors"
    released = tmp_path / "go"

    def site_run(try_number: int, step: float) -> SiteRun:
        return SiteRun(
            job="late",
            run_id="run",
            round=1,
            total_rounds=1,
            site="site-1",
            task="train",
            argv=[sys.executable, str(trainer), str(released if try_number == 1 else trainer), str(step)],
            global_model=str(global_model),
            output=str(output),
            staging=str(run_dir / "round-0001" / "staging" / "site-1" / f"try-{try_number}" / "update.safetensors"),
            shutdown_timeout=2.0,
        )

    env = {**os.environ, SPEC_ENV: site_run(1, 1.0).to_json()}
    first = subprocess.Popen(
        [sys.executable, "-m", "flare_airflow.site_task"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not site_processes(str(tmp_path)) or len(site_processes(str(tmp_path))) < 2:
            assert time.monotonic() < deadline, "try 1's trainer did not start"
            time.sleep(0.05)
        rc, summary = run_site(site_run(2, 2.0), ProcessLauncher(sink=lambda line: None), handle_signals=False)
        assert rc is JobReturnCode.SUCCESS, summary
        assert isinstance(summary, dict)
        published = output.read_bytes()
        released.touch()
        _, err = first.communicate(timeout=60)
    finally:
        kill9(first.pid)
    assert first.returncode == int(JobReturnCode.ABORTED), err
    assert "try-1 of this site job was superseded by try-2: its update is not published" in err
    assert output.read_bytes() == published
    assert read_record(output).sha256 == summary["sha256"]
    np.testing.assert_array_equal(load_file(str(output))["w"], np.full(4, 2.0, np.float32))
    assert not (output.parent / "site-1.failure.json").exists(), "try 1 left no failure record over try 2's update"


# --- FedAdam: kill -9 of the aggregation task, and resume (issue 25) ----------------------------------
FEDADAM_JOB = "killdrill_fedadam"
FEDADAM_DAG = f"flare_{FEDADAM_JOB}"
FEDADAM_ROUNDS = 3
# 16 MiB of float32: the aggregation's server-state write (32 MiB, hashed twice, fsync'd) lasts long
# enough for the drill to see its temporary file appear and stop the task there, at any load.
FEDADAM_PARAMS = 1 << 22


def write_fedadam_job(stack: AirflowStack, store: pathlib.Path, may_run: pathlib.Path) -> None:
    """2 sites x 3 rounds of FedAdam; site-2 fails round 2 while ``may_run`` does not exist; one retry
    for every task (the aggregation's is what the kill drill uses)."""
    import numpy as np
    from safetensors.numpy import save_file

    folder = stack.dags / FEDADAM_JOB
    folder.mkdir()
    rng = np.random.default_rng(25)
    init = folder / "init.safetensors"
    save_file({"w": rng.standard_normal(FEDADAM_PARAMS).astype(np.float32), "b": np.zeros(3, np.float32)}, str(init))
    job = {
        "job": FEDADAM_JOB,
        "rounds": FEDADAM_ROUNDS,
        "min_clients": 2,
        "store": str(store),
        "initial_model": str(init),
        "aggregator": {"name": "fedadam", "eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 0.001},
        "trainer": {
            "script": str(TRAINERS / "behave.py"),
            "args": ["--fail-in-round", "site-2:2", "--until-file", str(may_run)],
            "shutdown_timeout": 2,
        },
        "evaluate": False,
        "sites": {"@default": {"retries": 0}, "site-1": {}, "site-2": {}},
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    (folder / "dag.py").write_text(
        textwrap.dedent(
            """
            from datetime import timedelta
            from pathlib import Path
            from flare_airflow.builder import build_dag
            dag = build_dag(
                Path(__file__).with_name("job.yaml"),
                default_args={"retries": 1, "retry_delay": timedelta(seconds=1)},
            )
            """
        )
    )


def fedadam_files(stack: AirflowStack, run_id: str) -> dict[str, str]:
    """sha256 of every round's global model and server state file (their metadata name the round,
    never the run), and of the published final model's tensors."""
    from flare_airflow.core.store import run_component

    run_dir = store_root(stack) / FEDADAM_JOB / run_component(run_id)
    files = {}
    for r in range(1, FEDADAM_ROUNDS + 1):
        for name in ("global.safetensors", "server_state.safetensors"):
            path = run_dir / f"round-{r:04d}" / name
            files[f"{r}/{name}"] = hashlib.sha256(path.read_bytes()).hexdigest()
            assert read_record(path).sha256 == files[f"{r}/{name}"], path
    files["final"] = tensors_sha256(_fedadam_xcom(stack, run_id, "publish")["final_model"])
    return files


def _fedadam_xcom(stack: AirflowStack, run_id: str, task_id: str) -> dict[str, Any]:
    body = stack.api("GET", f"/dags/{FEDADAM_DAG}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value")
    value = body["value"]
    return dict(json.loads(value) if isinstance(value, str) else value)


@pytest.fixture(scope="module")
def fedadam_reference(stack: AirflowStack, uninterrupted_runs: dict[str, str]) -> dict[str, str]:
    """One uninterrupted FedAdam run: what the drills must reproduce byte for byte."""
    run_id = uninterrupted_runs[FEDADAM_DAG]
    tis = stack.task_instances(FEDADAM_DAG, run_id)
    # Every task succeeded (a try lost to a loaded machine's missed heartbeat may have been retried:
    # a retry writes the same bytes, which is what the drills below assert).
    assert {t: ti["state"] for t, ti in tis.items() if ti["state"] != "success"} == {}
    summary = _fedadam_xcom(stack, run_id, f"round_2.{AGGREGATE_TASK}")
    assert summary["strategy"] == "fedadam" and summary["accepted"] == ["site-1", "site-2"]
    return fedadam_files(stack, run_id)


def test_kill_9_of_the_fedadam_aggregation_task_mid_aggregation(
    stack: AirflowStack, fedadam_reference: dict[str, str]
) -> None:
    """The real aggregation task of round 2 (its process, as Airflow records it) is stopped the moment
    it starts writing round 2's server state, then killed with SIGKILL: neither the state nor the
    global model of round 2 is complete. Airflow retries the task, which starts again from round 1's
    state; every round's model and state file, and the final model, are the uninterrupted run's."""
    import signal

    from flare_airflow.core.store import run_component

    (stack.root.parent / "site-2-may-run").touch()
    run_id = stack.trigger(FEDADAM_DAG)
    task = f"round_2.{AGGREGATE_TASK}"
    round_dir = store_root(stack) / FEDADAM_JOB / run_component(run_id) / "round-0002"
    deadline = time.monotonic() + 240
    pid = None
    while pid is None:
        assert time.monotonic() < deadline, f"{task} never ran"
        ti = stack.task_instances(FEDADAM_DAG, run_id).get(task, {})
        assert ti.get("state") not in ("success", "failed"), f"{task} ended before the drill saw it run: {ti}"
        if ti.get("state") == "running" and ti.get("pid"):
            pid = int(ti["pid"])
        else:
            time.sleep(0.2)
    assert "airflow" in cmdline(pid), cmdline(pid)
    while True:  # a tight loop: the state's temporary file is there for a fraction of a second
        assert alive(pid) and time.monotonic() < deadline, f"{task} (pid {pid}) never wrote its server state"
        with contextlib.suppress(FileNotFoundError):
            if any(n.startswith(".server_state.safetensors.") for n in os.listdir(round_dir)):
                os.kill(pid, signal.SIGSTOP)
                break
        time.sleep(0.001)
    writing = [
        link for fd in os.listdir(f"/proc/{pid}/fd")
        if ".server_state.safetensors." in (link := os.readlink(f"/proc/{pid}/fd/{fd}"))
    ]  # fmt: skip
    complete = sorted(p.name for p in round_dir.glob("*.json"))
    kill9(pid)
    assert complete == [], f"round 2 had complete artifacts when the task was killed: {complete}"
    print(f"aggregation task {pid} killed {'while writing ' + writing[0] if writing else 'after its state write'}")

    assert stack.wait_for_run(FEDADAM_DAG, run_id, timeout=240) == "success"
    tis = stack.task_instances(FEDADAM_DAG, run_id)
    assert {t: ti["state"] for t, ti in tis.items() if ti["state"] != "success"} == {}
    tries = stack.api("GET", f"/dags/{FEDADAM_DAG}/dagRuns/{run_id}/taskInstances/{task}/tries")["task_instances"]
    assert [t["state"] for t in sorted(tries, key=lambda t: t["try_number"])] == ["failed", "success"]
    assert fedadam_files(stack, run_id) == fedadam_reference


def test_resume_of_a_fedadam_run_failed_in_a_middle_round(
    stack: AirflowStack, fedadam_reference: dict[str, str]
) -> None:
    """site-2 fails round 2, so round 2's aggregation fails (quorum 2) and the run fails; once the
    site is fixed, `flare-airflow resume` runs round 2 on from round 1's state: the uninterrupted
    run's files, byte for byte."""
    may_run = stack.root.parent / "site-2-may-run"
    may_run.unlink()
    run_id = stack.trigger(FEDADAM_DAG)
    assert stack.wait_for_run(FEDADAM_DAG, run_id, timeout=300) == "failed"
    tis = stack.task_instances(FEDADAM_DAG, run_id)
    assert tis[f"round_2.{AGGREGATE_TASK}"]["state"] == "failed" and tis["round_2.site-2"]["state"] == "failed"
    assert tis[f"round_1.{AGGREGATE_TASK}"]["state"] == "success"
    may_run.touch()
    out = subprocess.run(
        [str(BIN / "flare-airflow"), "resume", FEDADAM_DAG, run_id, "--timeout", "300"],
        env=stack.env,
        capture_output=True,
        text=True,
        check=False,
        timeout=400,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tis = stack.task_instances(FEDADAM_DAG, run_id)
    assert {t: ti["state"] for t, ti in tis.items() if ti["state"] != "success"} == {}
    assert tis[f"round_1.{AGGREGATE_TASK}"]["try_number"] == 1  # a completed round is not run again
    assert fedadam_files(stack, run_id) == fedadam_reference
