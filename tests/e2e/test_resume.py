"""Resume from a failed round, through real Airflow on the embedded default (SQLite, no scheduler).

One site fails in round 2 until a marker file exists, so the round loses its quorum and the run
fails. Then: the Clear a user would click in the UI ("failed tasks + downstream, only failed") is
refused where it would publish a wrong model, and ``flare-airflow resume`` finishes the run with the
same final model as an uninterrupted run, reusing the completed rounds' stored global models.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import textwrap

import pytest

from flare_airflow_testing.harness import BIN, AirflowHome, RunResult, behave_job

pytestmark = pytest.mark.e2e

SITES = ("site-1", "site-2", "site-3")

# What the UI's "Clear" does for a set of tasks (the REST API's clearTaskInstances: expand the
# selection with partial_subset, then DAG.clear with only_failed), then the run executed in-process.
UI_CLEAR = textwrap.dedent(
    """
    import json, sys
    from airflow import settings
    from airflow.models.taskinstance import TaskInstance
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.cli import get_bagged_dag
    from sqlalchemy import select
    from flare_airflow.cli import resume

    dag_id, run_id, dagfile, downstream, only_failed = sys.argv[1:6]
    dag = get_bagged_dag(None, dag_id, dagfile)
    sdag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    session = settings.Session()
    tis = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id))
    failed = [ti.task_id for ti in tis if ti.state == "failed"]
    sub = sdag.partial_subset(task_ids=failed, include_downstream=downstream == "1", include_upstream=False)
    sdag.clear(task_ids=list(sub.task_dict), run_id=run_id, only_failed=only_failed == "1", session=session)
    session.commit()
    print(json.dumps({"state": resume.run_in_process(dag, sdag, run_id, session)}))
    """
)


def _job(home: AirflowHome, name: str, marker: pathlib.Path) -> pathlib.Path:
    args = ["--fail-in-round", "site-2:2", "--until-file", str(marker)]
    job = behave_job(home.root, name, sites=3, rounds=3, min_clients=3, args=args)
    return home.write_job(name.replace("-", "_"), job)


def _run_states(home: AirflowHome, dag_id: str, run_id: str) -> dict[str, dict[str, object]]:
    code = (
        "import json, sys; from flare_airflow.cli.dag_runs import run_state; "
        "print(json.dumps(run_state(sys.argv[1], sys.argv[2])))"
    )
    out = subprocess.run(
        [str(BIN / "python"), "-c", code, dag_id, run_id], env=home.env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _resume(home: AirflowHome, dag_id: str, run_id: str, dag_file: pathlib.Path, *extra: str) -> tuple[int, str]:
    cmd = [str(BIN / "flare-airflow"), "resume", dag_id, run_id, "--dagfile", str(dag_file), *extra]
    out = subprocess.run(cmd, env=home.env, capture_output=True, text=True, check=False, timeout=600, cwd=home.root)
    return out.returncode, out.stdout + out.stderr


def _failed_run(home: AirflowHome, name: str, marker: pathlib.Path) -> tuple[pathlib.Path, RunResult]:
    dag_file = _job(home, name, marker)
    result = home.run(f"flare_{name.replace('-', '_')}", dag_file)
    tasks = result.tasks
    assert result.returncode != 0 and result.state["state"] == "failed", result.log[-3000:]
    assert {tasks[f"round_1.{s}"] for s in SITES} | {tasks["round_1.global_model"], tasks["prepare"]} == {"success"}
    assert tasks["round_2.site-2"] == "failed"
    assert tasks["round_2.site-1"] == tasks["round_2.site-3"] == "success"
    assert tasks["round_2.global_model"] == "failed"
    assert {tasks[f"round_3.{s}"] for s in SITES} == {"upstream_failed"}
    assert tasks["round_3.global_model"] == "skipped"  # all_done: it ran and found no round-2 model
    assert tasks["publish"] == "upstream_failed"
    return dag_file, result


def _global(home: AirflowHome, job: str, run_id: str, r: int) -> pathlib.Path:
    (run_dir,) = [p for p in (home.store / job).iterdir() if p.is_dir()]
    return run_dir / f"round-{r:04d}" / "global.safetensors"


def _fingerprint(path: pathlib.Path) -> tuple[int, int, bytes]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, path.read_bytes()


def test_resume_continues_from_the_failed_round_with_the_uninterrupted_model(
    airflow_home: AirflowHome, tmp_path: pathlib.Path
) -> None:
    present = tmp_path / "fixed"
    present.touch()
    straight = airflow_home.run("flare_straight", _job(airflow_home, "straight", present))
    assert straight.state["state"] == "success" and set(straight.tasks.values()) == {"success"}, straight.log[-3000:]
    expected_sha = straight.state["published"]["sha256"]

    marker = tmp_path / "site-2-fixed"
    dag_file, failed = _failed_run(airflow_home, "resumed", marker)
    run_id = failed.state["run_id"]
    keep = {r: _fingerprint(_global(airflow_home, "resumed", run_id, r)) for r in (0, 1)}
    assert not _global(airflow_home, "resumed", run_id, 2).exists()

    marker.touch()  # the site is fixed
    rc, out = _resume(airflow_home, "flare_resumed", run_id, dag_file)
    assert rc == 0, out
    assert "from round 2 of 3" in out and "keeping the verified global models of round 0" in out, out
    assert "round 2: success" in out and "publish: success      round 3 model" in out, out
    state = _run_states(airflow_home, "flare_resumed", run_id)
    assert state["state"] == "success"
    tries = {t: (i["state"], i["try_number"]) for t, i in state["tasks"].items()}  # type: ignore[index]
    # prepare and round 1 untouched (their first try); round 2 ran again (second try, all three
    # sites, so the round aggregates every site it can); round 3's aggregation (skipped before) ran
    # again; round 3's sites and publish (upstream_failed before) ran for the first time.
    for task in ("prepare", "round_1.global_model", *(f"round_1.{s}" for s in SITES)):
        assert tries[task] == ("success", 1), (task, tries[task])
    for task in ("round_2.global_model", "round_3.global_model", *(f"round_2.{s}" for s in SITES)):
        assert tries[task] == ("success", 2), (task, tries[task])
    for task in ("publish", *(f"round_3.{s}" for s in SITES)):
        assert tries[task] == ("success", 1), (task, tries[task])
    published = state["published"]
    assert isinstance(published, dict) and published["round"] == 3
    assert published["sha256"] == expected_sha
    # completed rounds' global models reused, not recomputed: same inode, mtime and bytes
    for r, before in keep.items():
        assert _fingerprint(_global(airflow_home, "resumed", run_id, r)) == before, f"round {r} model rewritten"
    # Nothing left to do: a second resume says so and succeeds.
    rc, out = _resume(airflow_home, "flare_resumed", run_id, dag_file)
    assert rc == 0 and "nothing to do" in out, out


def test_ui_clear_of_failed_tasks_never_publishes_an_earlier_rounds_model(
    airflow_home: AirflowHome, tmp_path: pathlib.Path
) -> None:
    marker = tmp_path / "site-2-fixed"
    dag_file, failed = _failed_run(airflow_home, "cleared", marker)
    run_id, dag_id = failed.state["run_id"], "flare_cleared"
    marker.touch()
    # The UI's natural choice: Clear the failed task with "Downstream" on and "Only failed" on.
    out = subprocess.run(
        [str(BIN / "python"), "-c", UI_CLEAR, dag_id, run_id, str(dag_file), "1", "1"],
        env=airflow_home.env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    state = _run_states(airflow_home, dag_id, run_id)
    tasks = {t: i["state"] for t, i in state["tasks"].items()}  # type: ignore[index]
    # Round 2 re-ran and now has its quorum; round 3's aggregation stayed skipped (not cleared) ...
    assert {tasks[f"round_2.{s}"] for s in SITES} | {tasks["round_2.global_model"]} == {"success"}
    assert tasks["round_3.global_model"] == "skipped"
    # ... so round 3's sites refuse to train for nothing, and publish refuses round 2's model as final.
    assert {tasks[f"round_3.{s}"] for s in SITES} == {"failed"}
    assert tasks["publish"] == "failed"
    assert state["state"] == "failed" and state["published"] is None
    (run_dir,) = [p for p in (airflow_home.store / "cleared").iterdir() if p.is_dir()]
    assert not (run_dir / "final").exists()
    files = (airflow_home.home / "logs").rglob("*.log")
    log = out.stdout + out.stderr + "\n".join(p.read_text(errors="replace") for p in files)
    assert "round 3 produced no global model in this run" in log
    assert f"flare-airflow resume {dag_id} {run_id}" in log
    assert "already finished (skipped) and was not cleared with this task" in log
    # flare-airflow resume repairs it: round 3 and publish only; rounds 1-2 kept.
    round2 = _fingerprint(_global(airflow_home, "cleared", run_id, 2))
    rc, text = _resume(airflow_home, dag_id, run_id, dag_file)
    assert rc == 0, text
    assert "from round 3 of 3" in text, text
    state = _run_states(airflow_home, dag_id, run_id)
    tasks = {t: i["state"] for t, i in state["tasks"].items()}  # type: ignore[index]
    assert state["state"] == "success" and set(tasks.values()) == {"success"}, tasks
    assert _fingerprint(_global(airflow_home, "cleared", run_id, 2)) == round2
    published = state["published"]
    assert isinstance(published, dict) and published["round"] == 3
    assert os.path.exists(published["final_model"].removeprefix("file://"))
