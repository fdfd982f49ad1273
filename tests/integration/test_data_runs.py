"""Runs driven by the sites' data (issue 39) on a real scheduler (PostgreSQL, LocalExecutor).

One stack start for every scenario, one after another, on one job of 4 sites (min_sites 3,
min_clients 2, warm start on): two announcements start nothing, a duplicate is one, the third
site starts exactly one run over those three; a late site's announcement waits for the next
window with a forged one (site-1's key under site-3's name) that Airflow counts and ``prepare``
refuses. Two manual runs of the same job (another DAG, run alongside) with the same participants
give the bitwise-same model as the two data-driven ones.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import pathlib
import subprocess
import time
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from flare_airflow.core.data_ready import SITE_DATA_ASSET, data_payload
from flare_airflow.core.model import read_artifact
from flare_airflow.core.trust import generate_keys, sign_record
from flare_airflow.core.trust.keys import party_dir
from flare_airflow.core.trust.settings import TrustSettings
from flare_airflow_testing.harness import behave_job
from flare_airflow_testing.stack import BIN, AirflowStack, Postgres, scheduler_stack

DAG_ID = "flare_data_runs"
MANUAL_DAG_ID = "flare_data_runs_manual"
DAG_KW = f", dag_id={MANUAL_DAG_ID!r}, schedule=None"
SITES = ("site-1", "site-2", "site-3", "site-4")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: Postgres):
    with scheduler_stack(tmp_path_factory.mktemp("stack"), postgres=postgres) as airflow:
        yield airflow


def _announce(stack: AirflowStack, site: str, version: str) -> float:
    """``flare-airflow site data-ready`` as a site admin runs it; returns when it returned (epoch s)."""
    out = subprocess.run(
        [str(BIN / "flare-airflow"), "site", "data-ready", site, "--version", version, "--samples", "10"],
        env=stack.env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"site {site} announced data {version} (10 samples)" in out.stdout
    return time.time()


def _post_signed(stack: AirflowStack, keys: TrustSettings, site: str, version: str, signer: str) -> None:
    """An announcement posted straight to the REST API, signed by ``signer`` (a forgery when it is
    not ``site``): what a site admin holding REST credentials could do without the CLI."""
    payload = data_payload(site=site, version=version, samples=10, announced_at=dt.datetime.now(dt.UTC))
    kid, key = keys.signing_key(signer)
    asset = next(a for a in stack.api("GET", "/assets")["assets"] if a["name"] == SITE_DATA_ASSET)
    extra = {**payload, "signed": sign_record(payload, kid, key)}
    stack.api("POST", "/assets/events", json={"asset_id": asset["id"], "partition_key": site, "extra": extra})


def _runs(stack: AirflowStack, dag_id: str = DAG_ID) -> list[dict[str, Any]]:
    runs = stack.api("GET", f"/dags/{dag_id}/dagRuns", params={"order_by": "id"})["dag_runs"]
    return sorted(runs, key=lambda r: r["run_after"])


def _wait_runs(stack: AirflowStack, count: int, timeout: float = 90) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = _runs(stack)
        if len(runs) >= count:
            return runs
        time.sleep(0.5)
    raise AssertionError(f"{count} run(s) of {DAG_ID} expected, found {len(_runs(stack))}")


def _xcom(stack: AirflowStack, run_id: str, task_id: str, dag_id: str = DAG_ID) -> Any:
    body = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value")
    value = body["value"]
    return json.loads(value) if isinstance(value, str) else value


def _final_tensors(stack: AirflowStack, run_id: str, dag_id: str = DAG_ID) -> dict[str, np.ndarray]:
    published = _xcom(stack, run_id, "publish", dag_id)
    params, _ = read_artifact(pathlib.Path(published["final_model"].removeprefix("file:")))  # type: ignore[arg-type]
    return params


def _job_page(stack: AirflowStack, dag_id: str = DAG_ID) -> str:
    """The Federated runs page of the job (the per-site data panel), as the UI user sees it."""
    r = httpx.get(
        f"{stack.base}/flare/dags/{dag_id}", headers={"Authorization": f"Bearer {stack._login()}"}, timeout=60
    )
    r.raise_for_status()
    return html.unescape(r.text)


def _no_new_run(stack: AirflowStack, count: int, seconds: float = 8) -> None:
    """The scheduler loops every second: give it several loops to (wrongly) start a run."""
    time.sleep(seconds)
    assert len(_runs(stack)) == count, [r["dag_run_id"] for r in _runs(stack)]


def test_sites_data_drives_runs_on_the_fresh_sites(stack: AirflowStack, tmp_path: pathlib.Path) -> None:
    keys = TrustSettings(key_dir=str(stack.home / "flare-keys"))
    for site in SITES:
        generate_keys(site, party_dir(pathlib.Path(keys.key_dir), site))
    job = behave_job(tmp_path, "data-runs", sites=4, rounds=1, min_clients=2, args=[])
    job["warm_start"] = True
    # The same job by hand, run next to the data-driven one: a DAG of its own that runs only from
    # the form, with a store of its own (its warm starts read their own latest.json). Two manual
    # runs with the participants the two data-driven runs will have.
    job["trigger"] = {"on_data": {"min_sites": 3, "window": "1d"}}
    _write_dag(stack.dags / "data", job)
    _write_dag(stack.dags / "manual", {**job, "store": str(tmp_path / "by-hand")}, DAG_KW)
    manual_1 = stack.trigger(MANUAL_DAG_ID, conf={"warm_start": False, "sites": ["site-1", "site-2", "site-3"]})
    manual_2 = stack.trigger(MANUAL_DAG_ID, conf={"warm_start": True, "sites": ["site-1", "site-4"]})
    stack.wait_for_dag(DAG_ID)
    stack.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})

    # Window 1: two sites, one of them twice -> nothing; the third site -> exactly one run.
    _announce(stack, "site-1", "v1")
    _announce(stack, "site-2", "v1")
    _announce(stack, "site-2", "v1")
    _no_new_run(stack, 0, seconds=6)
    waiting = _job_page(stack)  # the UI says why there is no run
    assert "2 site(s) announced data no run has used yet: site-1, site-2. No run yet:" in waiting, waiting
    assert "runs when 3 of its 4 sites announced fresh data (window 1d)" in waiting
    formed = _announce(stack, "site-3", "v1")
    first = _wait_runs(stack, 1)[0]["dag_run_id"]
    assert stack.wait_for_run(DAG_ID, first) == "success"
    tis = stack.task_instances(DAG_ID, first)
    assert {s: tis[f"round_1.{s}"]["state"] for s in SITES} == {
        "site-1": "success", "site-2": "success", "site-3": "success", "site-4": "skipped"
    }  # fmt: skip
    started = min(dt.datetime.fromisoformat(tis[f"round_1.{s}"]["start_date"]).timestamp() for s in SITES[:3])
    latency = started - formed
    (stack.root.parent / "data-trigger-latency.json").write_text(json.dumps({"seconds": latency}))
    print(f"quorum-forming announcement -> first site task started: {latency:.1f} s")
    prepared = _xcom(stack, first, "prepare")
    assert prepared["participants"] == ["site-1", "site-2", "site-3"]
    assert prepared["sat_out"] == {"site-4": "no data announced since its last run"}
    published = _xcom(stack, first, "publish")
    metrics = json.loads(pathlib.Path(published["metrics"].removeprefix("file:")).read_text())
    assert metrics["data_versions"] == {"site-1": "v1", "site-2": "v1", "site-3": "v1"}
    assert metrics["data"]["site-4"]["reason"] == "no data announced since its last run"
    events = stack.api("GET", "/assets/events", params={"limit": 100})["asset_events"]
    model_event = [e for e in events if e["name"] == "flare_airflow.data-runs.global_model"]
    assert model_event[-1]["extra"]["data_versions"] == metrics["data_versions"]

    # Window 2: site-4 was late for window 1 and counts now; site-1 again; a forged site-3.
    _announce(stack, "site-4", "v2")
    _no_new_run(stack, 1, seconds=4)
    _post_signed(stack, keys, "site-3", "forged", signer="site-1")
    _post_signed(stack, keys, "site-1", "v2", signer="site-1")
    second = _wait_runs(stack, 2)[-1]["dag_run_id"]
    assert stack.wait_for_run(DAG_ID, second) == "success"
    prepared = _xcom(stack, second, "prepare")
    assert prepared["participants"] == ["site-1", "site-4"], prepared
    assert "its announcement was refused" in prepared["sat_out"]["site-3"]
    assert "not by 'site-3'" in prepared["sat_out"]["site-3"]
    assert "warm start from run " + first in prepared["source"]
    panel = _job_page(stack).split("<h2>Site data</h2>")[1]
    assert '<tr data-site="site-2"><th>site-2</th><td>v1</td>' in panel and first in panel
    assert '<tr data-site="site-4"><th>site-4</th><td>v2</td>' in panel and second in panel

    # The same participants by hand: the bitwise-same model.
    assert stack.wait_for_run(MANUAL_DAG_ID, manual_1) == "success"
    assert stack.wait_for_run(MANUAL_DAG_ID, manual_2) == "success"
    by_hand = _xcom(stack, manual_2, "prepare", MANUAL_DAG_ID)
    assert by_hand["participants"] == ["site-1", "site-4"] and "warm start from run " + manual_1 in by_hand["source"]
    data_model = _final_tensors(stack, second)
    manual_model = _final_tensors(stack, manual_2, MANUAL_DAG_ID)
    assert data_model.keys() == manual_model.keys()
    for name in data_model:
        assert data_model[name].tobytes() == manual_model[name].tobytes(), name
    assert not np.array_equal(data_model["w"], _final_tensors(stack, first)["w"])  # warm start moved it on


WAIT_DAG_ID = "flare_data_wait"
WAIT_SITES = ("wsite-1", "wsite-2", "wsite-3", "wsite-4")  # own partitions: the first job's data is not theirs
FALLBACK_DAG_ID = "flare_data_fallback"
FALLBACK_SITES = ("fsite-1", "fsite-2", "fsite-3")


def _wait_for(what: str, check: Any, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(1)
    raise AssertionError(f"no {what} within {timeout} s")


def _watch_says(stack: AirflowStack, after: float) -> str | None:
    """The data watch's decision of its newest run that finished after ``after`` (epoch s)."""
    runs = _runs(stack, WAIT_DAG_ID + "_data_watch")
    for run in reversed(runs):
        ended = run.get("end_date")
        if run["state"] == "success" and ended and dt.datetime.fromisoformat(ended).timestamp() > after:
            return str(_xcom(stack, run["dag_run_id"], "decide", WAIT_DAG_ID + "_data_watch")["why"])
    return None


def test_the_wait_runs_over_a_quorum_of_fresh_sites_and_never_reuses_them(
    stack: AirflowStack, tmp_path: pathlib.Path
) -> None:
    """wait 20s (min_sites 3, quorum 2): one site when the wait expires -> no run, and why; a second
    site -> a run over the two; a third site completes Airflow's own count with the two used ones
    still in its queue -> that run refuses to train on them again. Alongside, a job of its own with
    a cron fallback (every minute, no wait): two of three sites fresh -> the fallback runs over them."""
    stack.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": True})  # the first scenario's job is done
    keys = TrustSettings(key_dir=str(stack.home / "flare-keys"))
    for site in WAIT_SITES + FALLBACK_SITES:
        generate_keys(site, party_dir(pathlib.Path(keys.key_dir), site))
    fallback = behave_job(tmp_path, "data-fallback", sites=0, rounds=1, min_clients=2, args=[])
    fallback["sites"].update({site: {} for site in FALLBACK_SITES})
    fallback.update(schedule="* * * * *", trigger={"on_data": {"min_sites": 3, "window": "1d"}})
    _write_dag(stack.dags / "fallback", fallback)
    job = behave_job(tmp_path, "data-wait", sites=0, rounds=1, min_clients=2, args=[])
    job["sites"].update({site: {} for site in WAIT_SITES})
    job["trigger"] = {"on_data": {"min_sites": 3, "window": "1d", "wait": "20s"}}
    _write_dag(stack.dags / "wait", job)
    _announce(stack, "fsite-1", "f1")
    _announce(stack, "fsite-3", "f1")
    for dag_id in (WAIT_DAG_ID, FALLBACK_DAG_ID):
        for each in (dag_id, dag_id + "_data_watch"):
            stack.wait_for_dag(each)
            stack.api("PATCH", f"/dags/{each}", json={"is_paused": False})

    first = _announce(stack, "wsite-1", "w1")
    why = _wait_for("watch decision after the wait", lambda: _watch_says(stack, first + 21))
    assert "the wait expired at" in why and "below the quorum min_clients 2" in why, why
    assert _runs(stack, WAIT_DAG_ID) == []
    assert "Data watch (wait, fallback): " in _job_page(stack, WAIT_DAG_ID)  # the job page says why

    _announce(stack, "wsite-2", "w1")
    run = _wait_for("run started by the wait", lambda: _runs(stack, WAIT_DAG_ID))[0]["dag_run_id"]
    assert stack.wait_for_run(WAIT_DAG_ID, run) == "success"
    prepared = _xcom(stack, run, "prepare", WAIT_DAG_ID)
    assert prepared["participants"] == ["wsite-1", "wsite-2"], prepared
    assert {s: prepared["data"][s]["version"] for s in ("wsite-1", "wsite-2")} == {"wsite-1": "w1", "wsite-2": "w1"}

    # Airflow's queue still holds wsite-1 and wsite-2: with wsite-3 it counts 3 and starts a run.
    _announce(stack, "wsite-3", "w1")
    runs = _wait_for("Airflow's data run", lambda: (r := _runs(stack, WAIT_DAG_ID))[1:] and r)
    assert len(runs) == 2 and stack.wait_for_run(WAIT_DAG_ID, runs[1]["dag_run_id"]) == "failed"
    tis = stack.task_instances(WAIT_DAG_ID, runs[1]["dag_run_id"])
    assert tis["prepare"]["state"] == "failed" and tis["round_1.wsite-1"]["state"] != "success"
    _no_new_run_of(stack, WAIT_DAG_ID, 2, seconds=15)  # wsite-3 alone is below the quorum

    # The fallback: a minute passed with no run of its job -> a run over the two fresh sites.
    done = _wait_for("fallback run", lambda: _runs(stack, FALLBACK_DAG_ID), timeout=150)[0]["dag_run_id"]
    assert stack.wait_for_run(FALLBACK_DAG_ID, done) == "success"
    prepared = _xcom(stack, done, "prepare", FALLBACK_DAG_ID)
    assert prepared["participants"] == ["fsite-1", "fsite-3"], prepared
    assert prepared["data"]["fsite-1"]["version"] == "f1" and "fsite-2" in prepared["sat_out"]


def _no_new_run_of(stack: AirflowStack, dag_id: str, count: int, seconds: float) -> None:
    time.sleep(seconds)
    assert len(_runs(stack, dag_id)) == count, [r["dag_run_id"] for r in _runs(stack, dag_id)]


def _write_dag(folder: pathlib.Path, job: dict[str, Any], kwargs: str = "") -> None:
    folder.mkdir()
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    (folder / "dag.py").write_text(
        "from pathlib import Path\nfrom flare_airflow.builder import build_dag\n"
        f"dag = build_dag(Path(__file__).with_name('job.yaml'){kwargs})\n"
    )
