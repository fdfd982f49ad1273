"""Runs driven by the sites' data (issue 39): how long after the quorum-forming announcement the
run's first site task starts, under the real scheduler.

One deployment (flare_airflow_testing/stack.py: private PostgreSQL, api-server, scheduler with the
LocalExecutor, dag-processor; Airflow's default scheduler settings but a 1 s heartbeat, as in the
tests) and one job of 3 process sites (the no-op trainer, 1 round, ``min_sites: 2``). Each
repetition: site-1 announces (REST, signed), then site-2 with ``flare-airflow site data-ready`` --
the announcement that forms the quorum -- and the run is followed to its end. Timed from the
asset event's own timestamp (when Airflow stored the announcement): the run created (its
``queued_at``), ``prepare`` started, the first site task started; and the CLI's wall time apart
(it imports Airflow to read the connection).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import BenchmarkFailed, Table, log, median, spread
from bench_scale import TRAINER, write_init_model

SITES = ["site-1", "site-2", "site-3"]
DAG_ID = "flare_bench_data"


def _ts(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


def _write(dags: Path, init: Path, store: Path) -> None:
    job = {
        "job": "bench-data",
        "rounds": 1,
        "min_clients": 2,
        "initial_model": str(init),
        "trainer": {"script": str(TRAINER)},
        "evaluate": False,
        "store": str(store),
        "trigger": {"on_data": {"min_sites": 2, "window": "1d"}},
        "sites": {"@default": {"launcher": "process", "retries": 0}, **{s: {} for s in SITES}},
    }
    (dags / "bench_data.yaml").write_text(json.dumps(job, indent=1) + "\n")
    (dags / "bench_data_dag.py").write_text(
        "from pathlib import Path\n\nfrom flare_airflow.builder import build_dag\n\n"
        f'dag = build_dag(Path(__file__).with_name("bench_data.yaml"), dag_id="{DAG_ID}")\n'
    )


def _post(stack: Any, site: str, version: str) -> None:
    from flare_airflow.core.data_ready import SITE_DATA_ASSET, data_payload
    from flare_airflow.core.trust import sign_record
    from flare_airflow.core.trust.settings import TrustSettings

    keys = TrustSettings(key_dir=str(stack.home / "flare-keys"))
    payload = data_payload(site=site, version=version, samples=10, announced_at=dt.datetime.now(dt.UTC))
    kid, key = keys.signing_key(site)
    asset = next(a for a in stack.api("GET", "/assets")["assets"] if a["name"] == SITE_DATA_ASSET)
    extra = {**payload, "signed": sign_record(payload, kid, key)}
    stack.api("POST", "/assets/events", json={"asset_id": asset["id"], "partition_key": site, "extra": extra})


def _one(stack: Any, rep: int, cli: Path) -> dict[str, float]:
    from flare_airflow.core.data_ready import SITE_DATA_ASSET

    before = {r["dag_run_id"] for r in stack.api("GET", f"/dags/{DAG_ID}/dagRuns")["dag_runs"]}
    _post(stack, "site-1", f"r{rep}")
    started = time.monotonic()
    out = subprocess.run(
        [str(cli), "site", "data-ready", "site-2", "--version", f"r{rep}"],
        env=stack.env,
        capture_output=True,
        text=True,
        check=False,
    )
    cli_s = time.monotonic() - started
    if out.returncode != 0:
        raise BenchmarkFailed(f"data-ready failed: {out.stdout}{out.stderr}")
    asset = next(a for a in stack.api("GET", "/assets")["assets"] if a["name"] == SITE_DATA_ASSET)
    events = stack.api("GET", "/assets/events", params={"asset_id": asset["id"], "order_by": "-timestamp", "limit": 1})
    announced = _ts(events["asset_events"][0]["timestamp"])
    deadline = time.monotonic() + 300
    run_id = None
    while time.monotonic() < deadline and run_id is None:
        runs = stack.api("GET", f"/dags/{DAG_ID}/dagRuns")["dag_runs"]
        new = [r for r in runs if r["dag_run_id"] not in before]
        run_id = new[0]["dag_run_id"] if new else None
        time.sleep(0.2)
    if run_id is None:
        raise BenchmarkFailed("no run started after the quorum-forming announcement")
    if stack.wait_for_run(DAG_ID, run_id) != "success":
        raise BenchmarkFailed(f"run {run_id} failed; see {stack.root}")
    run = stack.api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")
    tis = stack.task_instances(DAG_ID, run_id)
    first_site = min(_ts(tis[f"round_1.{s}"]["start_date"]) for s in ("site-1", "site-2"))
    if tis["round_1.site-3"]["state"] != "skipped":
        raise BenchmarkFailed(f"site-3 should sit the run out, is {tis['round_1.site-3']['state']}")
    return {
        "cli": cli_s,
        "created": _ts(run["queued_at"]) - announced,
        "prepare": _ts(tis["prepare"]["start_date"]) - announced,
        "site": first_site - announced,
    }


def run(*, reps: int, keep: bool, tmp_base: str | None) -> list[Table]:
    from flare_airflow.core.trust import generate_keys
    from flare_airflow.core.trust.keys import party_dir
    from flare_airflow_testing.stack import BIN, AirflowStack, Postgres

    tmp = Path(tempfile.mkdtemp(prefix="flare-bench-data-", dir=tmp_base))
    ok = False
    pg = stack = None
    try:
        pg = Postgres()
        stack = AirflowStack(tmp / "stack", pg.url)
        init = tmp / "init.safetensors"
        write_init_model(init)
        _write(stack.dags, init, tmp / "store")
        for site in SITES:
            generate_keys(site, party_dir(stack.home / "flare-keys", site))
        stack.start()
        stack.wait_for_dag(DAG_ID)
        stack.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
        log("[data-trigger] untimed first run ...")
        _one(stack, 0, BIN / "flare-airflow")
        results = []
        for rep in range(1, reps + 1):
            results.append(_one(stack, rep, BIN / "flare-airflow"))
            log(f"[data-trigger] rep {rep}: " + ", ".join(f"{k} {v:.2f} s" for k, v in results[-1].items()))
        ok = True
    finally:
        if stack is not None:
            stack.stop()
        if pg is not None:
            pg.stop()
        if keep or not ok:
            log(f"[data-trigger] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    table = Table(
        "From the quorum-forming announcement (the asset event's timestamp) to ...",
        ["step", "median s", "min-max s"],
    )
    for key, label in (
        ("created", "the run created (queued_at)"),
        ("prepare", "prepare started"),
        ("site", "the first site task started"),
        ("cli", "`flare-airflow site data-ready` wall time (apart: before the event)"),
    ):
        values = [r[key] for r in results]
        table.add(label, f"{median(values):.2f}", spread(values))
    table.notes.append(
        f"{reps} repetitions after one untimed run; 3 process sites, min_sites 2, the no-op trainer, 1 round. "
        "The scheduler creates the run in its next loop (heartbeat 1 s here); the rest is Airflow scheduling "
        "prepare and then the site tasks (each a task process that imports Airflow)."
    )
    return [table]
