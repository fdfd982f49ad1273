"""``flare-airflow resume`` with a real scheduler (PostgreSQL, LocalExecutor): the clear goes to the
metadata database and the scheduler runs the cleared tasks; completed rounds are not run again."""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import time

import httpx
import pytest
import yaml

from flare_airflow_testing.harness import behave_job
from flare_airflow_testing.stack import BIN, AirflowStack, Postgres, scheduler_stack

SITES = ("site-1", "site-2", "site-3")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: Postgres):
    with scheduler_stack(tmp_path_factory.mktemp("stack"), postgres=postgres) as airflow:
        yield airflow


def test_resume_lets_the_running_scheduler_finish_the_run(stack: AirflowStack, tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "site-2-fixed"
    folder = stack.dags / "sched_resume"
    folder.mkdir()
    args = ["--fail-in-round", "site-2:2", "--until-file", str(marker)]
    job = behave_job(folder, "sched-resume", sites=3, rounds=2, min_clients=3, args=args)
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    (folder / "dag.py").write_text(
        "from pathlib import Path\nfrom flare_airflow.builder import build_dag\n"
        "dag = build_dag(Path(__file__).with_name('job.yaml'))\n"
    )
    dag_id = "flare_sched_resume"
    run_id = stack.trigger(dag_id)
    assert stack.wait_for_run(dag_id, run_id) == "failed"
    tis = stack.task_instances(dag_id, run_id)
    assert tis["round_2.site-2"]["state"] == "failed" and tis["round_2.global_model"]["state"] == "failed"
    assert tis["publish"]["state"] == "upstream_failed"

    marker.touch()
    out = subprocess.run(
        [str(BIN / "flare-airflow"), "resume", dag_id, run_id, "--timeout", "300"],
        env=stack.env,
        capture_output=True,
        text=True,
        check=False,
        timeout=400,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "a scheduler is running" in text and "from round 2 of 2" in text, text
    tis = stack.task_instances(dag_id, run_id)
    assert {ti["state"] for ti in tis.values()} == {"success"}, {t: ti["state"] for t, ti in tis.items()}
    for task in ("prepare", "round_1.global_model", *(f"round_1.{s}" for s in SITES)):
        assert tis[task]["try_number"] == 1, task  # completed round: not run again
    for task in ("round_2.global_model", *(f"round_2.{s}" for s in SITES)):
        assert tis[task]["try_number"] == 2, task
    assert stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"] == "success"


def _wait_states(stack: AirflowStack, dag_id: str, run_id: str, want: dict[str, str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    tis: dict[str, dict[str, object]] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TimeoutException):  # a loaded machine: ask again
            tis = stack.task_instances(dag_id, run_id)
        if all(tis.get(t, {}).get("state") == s for t, s in want.items()):
            return
        time.sleep(1)
    raise AssertionError(f"{want} not reached: { ({t: tis.get(t, {}).get('state') for t in want}) }")


def _clear(stack: AirflowStack, dag_id: str, run_id: str, task_ids: list[str], **options: bool) -> None:
    body = {"dag_run_id": run_id, "task_ids": task_ids, "dry_run": False, **options}
    stack.api("POST", f"/dags/{dag_id}/clearTaskInstances", json=body)


def _finished(stack: AirflowStack, dag_id: str, run_id: str) -> str:
    # A cleared run is queued synchronously by the API; wait for the scheduler to finish it again.
    deadline = time.monotonic() + 300
    while stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"] not in ("queued", "running"):
        if time.monotonic() > deadline:
            raise AssertionError("the cleared run was not queued")
        time.sleep(0.2)
    return stack.wait_for_run(dag_id, run_id)


def _failure(stack: AirflowStack, dag_id: str, run_id: str, task_id: str) -> str:
    path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/failure"
    return str(stack.api("GET", path)["value"])


def test_ui_clears_end_failed_with_what_to_do_or_give_the_uninterrupted_model(
    stack: AirflowStack, tmp_path: pathlib.Path
) -> None:
    """Issue 28 #7, the UI's recovery paths on one 3-site, 3-round run: *Mark run as failed* in
    round 2, then *Clear* of the failed site tasks without and with Downstream ('Only failed' on)
    must end failed with the reason and the fix -- never green without a model; the Clear the reason
    names gives the model of an uninterrupted run of the same job, bit for bit."""
    marker = tmp_path / "go-on"
    folder = stack.dags / "ui_clear"
    folder.mkdir()
    args = [
        *("--fail-in-round", "site-1:2", "--fail-in-round", "site-3:2"),
        *("--hang-in-round", "site-2:2", "--until-file", str(marker)),
    ]
    job = behave_job(folder, "ui-clear", sites=3, rounds=3, min_clients=3, args=args)
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    ref_job = behave_job(folder, "ui-clear-ref", sites=3, rounds=3, min_clients=3, args=[])
    (folder / "ref.yaml").write_text(yaml.safe_dump(ref_job))
    (folder / "dag.py").write_text(
        "from pathlib import Path\nfrom flare_airflow.builder import build_dag\n"
        "dag = build_dag(Path(__file__).with_name('job.yaml'))\n"
        # The reference only has to end with its model: retries absorb a task start that a loaded
        # machine's api-server did not answer in time.
        "from datetime import timedelta\n"
        "ref = build_dag(Path(__file__).with_name('ref.yaml'), default_args={'retries': 2, "
        "'retry_delay': timedelta(seconds=2)})\n"
    )
    dag_id, ref_id = "flare_ui_clear", "flare_ui_clear_ref"
    ref_run = stack.trigger(ref_id)
    _wait_states(stack, ref_id, ref_run, {"prepare": "success"})  # the stack answers task starts now
    run_id = stack.trigger(dag_id)
    _wait_states(
        stack, dag_id, run_id, {"round_2.site-1": "failed", "round_2.site-3": "failed", "round_2.site-2": "running"}
    )
    stack.api("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})  # Mark run as failed
    assert stack.wait_for_run(dag_id, run_id) == "failed"
    tis = stack.task_instances(dag_id, run_id)
    later = ("round_2.global_model", *(f"round_3.{s}" for s in (*SITES, "global_model")), "publish")
    assert {t: tis[t]["state"] for t in later} == dict.fromkeys(later, "skipped")
    assert tis["verdict"]["state"] == "failed"  # a teardown: not skipped by Mark run as failed
    reason = _failure(stack, dag_id, run_id, "verdict")
    assert "nothing published" in reason and "round 2" in reason, reason
    assert f"flare-airflow resume {dag_id} {run_id}" in reason and "'Only failed' off" in reason, reason

    marker.touch()
    # Clear of the failed site tasks, 'Only failed' on, no Downstream: their round's aggregation
    # stays skipped, so they refuse to train (their update could never count), saying what to clear.
    _clear(stack, dag_id, run_id, ["round_2.site-1", "round_2.site-3"], only_failed=True)
    assert _finished(stack, dag_id, run_id) == "failed"  # was: success with nothing published
    tis = stack.task_instances(dag_id, run_id)
    for site in ("site-1", "site-3"):
        assert tis[f"round_2.{site}"]["state"] == "failed" and tis[f"round_2.{site}"]["try_number"] == 2
        refused = _failure(stack, dag_id, run_id, f"round_2.{site}")
        assert "round_2.global_model already finished (skipped)" in refused and "resume" in refused, refused
    assert tis["round_2.site-2"]["state"] == "failed" and tis["verdict"]["state"] == "failed"
    assert {t: tis[t]["state"] for t in later} == dict.fromkeys(later, "skipped")

    # The same with Downstream: the verdict (failed) is cleared and judges again; skipped stays skipped.
    _clear(stack, dag_id, run_id, ["round_2.site-2"], only_failed=True, include_downstream=True)
    assert _finished(stack, dag_id, run_id) == "failed"
    tis = stack.task_instances(dag_id, run_id)
    assert tis["verdict"]["state"] == "failed" and tis["verdict"]["try_number"] == 2
    assert tis["round_2.site-2"]["state"] == "failed" and tis["round_2.site-2"]["try_number"] == 2
    assert {t: tis[t]["state"] for t in later} == dict.fromkeys(later, "skipped")
    reason = _failure(stack, dag_id, run_id, "verdict")
    assert "round 2 has no global model" in reason and "clear round_2" in reason, reason

    # What the reason says: the round's tasks with Downstream, 'Only failed' off.
    round_2 = [*(f"round_2.{s}" for s in SITES), "round_2.global_model"]
    _clear(stack, dag_id, run_id, round_2, only_failed=False, include_downstream=True)
    assert _finished(stack, dag_id, run_id) == "success"
    assert stack.wait_for_run(ref_id, ref_run) == "success"
    for run, dag in ((run_id, dag_id), (ref_run, ref_id)):
        tis = stack.task_instances(dag, run)
        assert {t: ti["state"] for t, ti in tis.items()} == dict.fromkeys(tis, "success"), dag
        assert len(tis) == 1 + 3 * 4 + 2, sorted(tis)
    for task in ("prepare", "round_1.global_model", *(f"round_1.{s}" for s in SITES)):
        assert stack.task_instances(dag_id, run_id)[task]["try_number"] == 1, task  # round 1 kept

    def final_global_model(dag: str, run: str) -> str:
        """The sha256 of round 3's global model (the final model's tensors; the published file's
        metadata names the run, so its bytes differ between runs)."""
        xcoms = f"/dags/{dag}/dagRuns/{run}/taskInstances"
        published = stack.api("GET", f"{xcoms}/publish/xcomEntries/return_value")["value"]
        summary = stack.api("GET", f"{xcoms}/round_3.global_model/xcomEntries/return_value")["value"]
        assert published["round"] == 3 and published["model_uri"].endswith("model.safetensors")
        return str(summary["sha256"])

    assert final_global_model(dag_id, run_id) == final_global_model(ref_id, ref_run)
