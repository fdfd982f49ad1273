"""GPU pools under Airflow's real scheduler (LocalExecutor, PostgreSQL): a site pool bounds how
many site jobs run at once, each running job has its own devices, and a missing or too small
pool is a clear error when the run starts instead of an eternal wait."""

from __future__ import annotations

import itertools
import json
import pathlib
import subprocess
import textwrap

import pytest
import yaml

from flare_airflow_testing.harness import tiny_model
from flare_airflow_testing.stack import BIN, AirflowStack, Postgres, scheduler_stack

TRAINERS = pathlib.Path(__file__).parent / "trainers"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: Postgres):
    root = tmp_path_factory.mktemp("stack")
    env = {"FLARE_GPU_LOCK_DIR": str(root / "gpu-locks")}
    with scheduler_stack(root, env, postgres=postgres, parallelism=6) as airflow:
        yield airflow


def write_job(
    stack: AirflowStack, name: str, sites: dict, extra: dict | None = None, args: list | None = None
) -> pathlib.Path:
    folder = stack.dags / name
    folder.mkdir()
    job = {
        "job": name,
        "rounds": 1,
        "min_clients": 1,
        "initial_model": str(tiny_model(folder / "init.safetensors")),
        "trainer": {"script": str(TRAINERS / "gpu_probe.py"), "args": args or [str(folder), "0"]},
        "evaluate": False,
        "sites": sites,
        **(extra or {}),
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
    return folder / "job.yaml"


def pools_sync(stack: AirflowStack, job: pathlib.Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "flare-airflow"), "pools", "sync", str(job), *extra],
        env=stack.env,
        capture_output=True,
        text=True,
        check=False,
    )


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def test_two_slot_pool_runs_at_most_two_one_gpu_jobs_with_distinct_devices(stack: AirflowStack) -> None:
    manager = {"type": "gpu", "num_of_gpus": 2, "pool": "flare_gpu_host-a"}
    sites = {"@default": {"resource_spec": {"num_of_gpus": 1}, "resource_manager": manager}}
    sites.update({f"site-{i}": {} for i in range(1, 5)})
    folder = stack.dags / "pooled"
    job = write_job(stack, "pooled", sites, args=[str(folder), "4"])

    check = pools_sync(stack, job, "--check")
    assert (
        check.returncode == 1
        and "'flare_gpu_host-a' (GPUs of site-1, site-2, site-3, site-4) does not exist" in check.stdout
    )
    synced = pools_sync(stack, job)
    assert synced.returncode == 0 and "created pool 'flare_gpu_host-a': 2 slot(s)" in synced.stdout
    again = pools_sync(stack, job)
    assert "nothing changed" in again.stdout
    pool = stack.api("GET", "/pools/flare_gpu_host-a")
    assert (pool["slots"], pool["include_deferred"]) == (2, True)

    run_id = stack.trigger("flare_pooled")
    assert stack.wait_for_run("flare_pooled", run_id) == "success"
    tis = stack.task_instances("flare_pooled", run_id)
    site_tis = {t: ti for t, ti in tis.items() if t.startswith("round_1.site-")}
    assert {ti["state"] for ti in tis.values()} == {"success"}
    assert {ti["pool"] for ti in site_tis.values()} == {"flare_gpu_host-a"}
    assert {ti["pool_slots"] for ti in site_tis.values()} == {1}

    # Airflow's own record: never more than two site tasks running at once.
    from datetime import datetime

    def ts(value: str) -> float:
        return datetime.fromisoformat(value).timestamp()

    assert max_overlap([(ts(ti["start_date"]), ts(ti["end_date"])) for ti in site_tis.values()]) <= 2

    # The trainers' own record: two ran together (the pool, not luck, is the limit) and no GPU
    # was held by two running jobs.
    records = [json.loads(p.read_text()) for p in (stack.home / "flare_store" / "pooled").rglob("gpu-probe.json")]
    assert sorted(r["site"] for r in records) == ["site-1", "site-2", "site-3", "site-4"]
    assert max_overlap([(r["start"], r["end"]) for r in records]) == 2
    assert all(r["devices"] in ("0", "1") for r in records)
    for a, b in itertools.combinations(records, 2):
        overlapping = a["start"] < b["end"] and b["start"] < a["end"]
        if overlapping:
            assert a["devices"] != b["devices"], (a, b)


def _prepare_log(stack: AirflowStack, dag_id: str, run_id: str) -> str:
    body = stack.api(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/prepare/logs/1", params={"full_content": True}
    )
    content = body.get("content", body)
    return json.dumps(content)


def test_missing_pool_fails_the_run_at_start_with_the_reason(stack: AirflowStack) -> None:
    manager = {"type": "gpu", "num_of_gpus": 2, "pool": "flare_gpu_nowhere"}
    write_job(stack, "nopool", {"site-1": {"resource_spec": {"num_of_gpus": 1}, "resource_manager": manager}})
    run_id = stack.trigger("flare_nopool")
    assert stack.wait_for_run("flare_nopool", run_id, timeout=120) == "failed"
    tis = stack.task_instances("flare_nopool", run_id)
    assert tis["prepare"]["state"] == "failed"
    assert tis["round_1.site-1"]["state"] == "upstream_failed"
    assert "pool 'flare_gpu_nowhere' (GPUs of site-1) does not exist" in _prepare_log(stack, "flare_nopool", run_id)


def test_pool_smaller_than_a_request_fails_the_run_at_start(stack: AirflowStack) -> None:
    stack.api("POST", "/pools", json={"name": "flare_gpu_small", "slots": 1, "include_deferred": True})
    manager = {"type": "gpu", "num_of_gpus": 2, "pool": "flare_gpu_small"}
    write_job(stack, "toosmall", {"site-1": {"resource_spec": {"num_of_gpus": 2}, "resource_manager": manager}})
    run_id = stack.trigger("flare_toosmall")
    assert stack.wait_for_run("flare_toosmall", run_id, timeout=120) == "failed"
    assert stack.task_instances("flare_toosmall", run_id)["prepare"]["state"] == "failed"
    log = _prepare_log(stack, "flare_toosmall", run_id)
    assert "pool 'flare_gpu_small' has 1 slot(s) but a site job of site-1 asks for 2 GPU(s)" in log
