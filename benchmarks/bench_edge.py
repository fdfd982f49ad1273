"""Sites at the sites: what Edge workers and an object store cost, side by side in one run.

1. **Per-round overhead of Edge workers.** One real deployment (flare_airflow_testing/edge_sites.py: PostgreSQL,
   api-server, scheduler with ``LocalExecutor,EdgeExecutor``, dag-processor, triggerer, one
   ``airflow edge worker`` per site on this machine) and two DAGs of the same job -- 2 process
   sites, the no-op trainer, ``evaluate: false``, the same local store -- one run by the central
   LocalExecutor, one with ``site_queues: true`` on the Edge workers (job poll interval 1 s).
   After one untimed run of each, runs of 1 and 3 rounds alternate; the per-round cost is the
   slope (T3 - T1) / 2, which leaves out each run's fixed cost.
2. **Model exchange.** What a site task moves per round -- download the global model and its
   record, upload an update and its record (operators/staging.py) -- and a verified read of the
   same artifact (sha256, strict safetensors), through the S3 endpoint (moto's standalone server,
   an emulator on loopback: it measures the client path, s3fs + signing + HTTP, not a real S3) and
   through the local store (file://), alternating, for models of 16, 64 and 256 MiB.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import BenchmarkFailed, Table, log, median, spread
from bench_scale import TRAINER, write_init_model

REPO = Path(__file__).resolve().parent.parent
SITES = ["site-1", "site-2"]
ROUNDS = (1, 3)
SIZES_MIB = (16, 64, 256)


def _write_job(folder: Path, dag_id: str, init: Path, store: Path, *, edge: bool) -> None:
    default: dict[str, Any] = {"launcher": "process"}
    job: dict[str, Any] = {
        "job": dag_id.replace("_", "-"),
        "rounds": max(ROUNDS),
        "min_clients": len(SITES),
        "initial_model": str(init),
        "trainer": {"script": str(TRAINER)},
        "evaluate": False,
        "store": str(store),
        "sites": {"@default": default, **{s: {} for s in SITES}},
    }
    if edge:
        job["site_queues"] = True
        default["executor"] = "EdgeExecutor"
    (folder / f"{dag_id}.yaml").write_text(json.dumps(job, indent=1) + "\n")
    (folder / f"{dag_id}_dag.py").write_text(
        "from pathlib import Path\n\nfrom flare_airflow.builder import build_dag\n\n"
        f'dag = build_dag(Path(__file__).with_name("{dag_id}.yaml"), dag_id="{dag_id}")\n'
    )


def _timed(stack: Any, dag_id: str, rounds: int) -> float:
    started = time.monotonic()
    run_id = stack.trigger(dag_id, {"rounds": rounds})
    state = stack.wait_for_run(dag_id, run_id, timeout=600)
    elapsed = time.monotonic() - started
    if state != "success":
        tis = stack.task_instances(dag_id, run_id)
        raise BenchmarkFailed(f"{dag_id}: {state}; { ({t: ti['state'] for t, ti in tis.items()}) }")
    return elapsed


def rounds_table(reps: int, root: Path) -> Table:
    from flare_airflow_testing.edge_sites import EdgeWorker, central_env, enrol
    from flare_airflow_testing.ports import free_port
    from flare_airflow_testing.s3_server import S3Server
    from flare_airflow_testing.stack import AirflowStack, Postgres, start_triggerer

    init = write_init_model(root / "init.safetensors")
    s3 = S3Server()
    pg = stack = None
    workers: list[EdgeWorker] = []
    times: dict[tuple[str, int], list[float]] = {}
    try:
        pg = Postgres()
        port = free_port()
        env = central_env(f"http://127.0.0.1:{port}", root / "central")
        stack = AirflowStack(root / "stack", pg.url, extra_env=env, port=port)
        stack.env.pop("AIRFLOW__API_AUTH__JWT_SECRET", None)  # the guide's deployment: no shared secret
        for dag_id, edge in (("local_sites", False), ("edge_sites", True)):
            _write_job(stack.dags, dag_id, init, root / "store", edge=edge)
        stack.start()
        start_triggerer(stack)
        workers = [EdgeWorker(root / "workers", site, stack, s3, queue=site) for site in SITES]
        enrol(root / "central", workers)
        for w in workers:
            # The same launcher and store as the central DAG's sites (no connection of its own).
            w.policy.write_text(json.dumps({"sites": {w.site: {"launcher": "process"}}}))
            w.start()
        log("[edge] deployment up")
        for dag_id in ("local_sites", "edge_sites"):  # not timed: the DAG's first parse, unpausing
            _timed(stack, dag_id, 1)
        for rep in range(reps):
            cases = [(d, r) for d in ("local_sites", "edge_sites") for r in ROUNDS]
            for dag_id, r in cases if rep % 2 == 0 else cases[::-1]:
                elapsed = _timed(stack, dag_id, r)
                times.setdefault((dag_id, r), []).append(elapsed)
                log(f"[edge] {dag_id} {r} round(s): {elapsed:.1f}s")
    finally:
        for w in workers:
            w.stop()
        if stack is not None:
            stack.stop()
        if pg is not None:
            pg.stop()
        s3.stop()
    table = Table(
        f"Per-round cost: site tasks on Edge workers vs the central LocalExecutor; {len(SITES)} process sites, "
        f"no-op trainer, same local store, real scheduler on PostgreSQL; trigger to end, median of {reps}",
        ["sites run by", "1 round (s)", "3 rounds (s)", "per round (T3 - T1) / 2 (s)", "runs (1 / 3 rounds)"],
    )
    slope = {}
    for dag_id, label in (("local_sites", "central LocalExecutor"), ("edge_sites", "Edge workers (poll 1 s)")):
        t1, t3 = times[(dag_id, 1)], times[(dag_id, 3)]
        slope[dag_id] = (median(t3) - median(t1)) / 2
        table.add(
            label,
            f"{median(t1):.1f}",
            f"{median(t3):.1f}",
            f"{slope[dag_id]:.1f}",
            f"{spread(t1, '{:.1f}')} / {spread(t3, '{:.1f}')}",
        )
    one = median(times[("edge_sites", 1)]) - median(times[("local_sites", 1)])
    table.notes.append(
        f"Edge workers vs the central executor: {slope['edge_sites'] - slope['local_sites']:+.1f} s per round, "
        f"{one:+.1f} s for a 1-round run (medians; compare with the runs' spread: this machine is shared). "
        "A site task on an Edge worker waits for the worker's next poll ([edge] job_poll_interval, 1 s here) "
        "and starts its task supervisor there."
    )
    return table


def exchange_table(reps: int, root: Path) -> Table:
    import numpy as np

    from flare_airflow.core.model import FLModel, read_artifact, write_artifact
    from flare_airflow.core.store import ModelStore
    from flare_airflow.operators.staging import _download, upload_result
    from flare_airflow_testing.s3_server import S3Server

    s3 = S3Server()
    os.environ["AIRFLOW_CONN_BENCH_STORE"] = s3.connection()
    from airflow.sdk import ObjectStoragePath

    stores = {
        "local (file://)": ModelStore(ObjectStoragePath(f"file://{root}/store")),
        "S3 (moto, loopback)": ModelStore(ObjectStoragePath("s3://flare/bench", conn_id="bench_store")),
    }
    results: dict[tuple[str, int, str], list[float]] = {}
    try:
        for size in SIZES_MIB:
            n = size * (1 << 20) // 4
            local = root / f"update-{size}" / "update.safetensors"
            local.parent.mkdir(parents=True)
            write_artifact(local, FLModel(params={"w": np.random.default_rng(0).random(n, dtype=np.float32)}))
            for rep in range(reps):
                order = list(stores.items())
                for label, store in order if rep % 2 == 0 else order[::-1]:
                    remote = store.root / f"m{size}" / "sites" / "site-1.safetensors"
                    started = time.perf_counter()
                    upload_result(local, remote)
                    up = time.perf_counter() - started
                    back = root / f"down-{size}" / "global.safetensors"
                    started = time.perf_counter()
                    _download(store, str(remote), back)
                    down = time.perf_counter() - started
                    started = time.perf_counter()
                    read_artifact(remote)
                    verified = time.perf_counter() - started
                    for kind, seconds in (("upload", up), ("download", down), ("verified read", verified)):
                        results.setdefault((label, size, kind), []).append(size / seconds)
                    shutil.rmtree(back.parent, ignore_errors=True)
                    log(f"[edge] {label} {size} MiB: up {size / up:.0f} MiB/s, down {size / down:.0f} MiB/s")
            shutil.rmtree(local.parent, ignore_errors=True)
    finally:
        s3.stop()
    table = Table(
        f"Model exchange per site task: upload (update + record), download (global model + record), "
        f"verified read (sha256, strict safetensors); MiB/s, median of {reps}",
        ["store", "model (MiB)", "upload", "download", "verified read", "runs (upload)"],
    )
    for label in stores:
        for size in SIZES_MIB:
            up, down, ver = (results[(label, size, k)] for k in ("upload", "download", "verified read"))
            table.add(
                label, size, f"{median(up):.0f}", f"{median(down):.0f}", f"{median(ver):.0f}", spread(up, "{:.0f}")
            )
    table.notes.append(
        "moto keeps objects in its own process's memory and serves them over loopback HTTP: the S3 rows "
        "measure the client path (s3fs, request signing, HTTP, moto's Python server), not a real S3 service."
    )
    return table


def run(*, reps: int, keep: bool, tmp_base: str | None) -> list[Table]:
    sys.path.insert(0, str(REPO))
    root = Path(tempfile.mkdtemp(prefix="flare-bench-edge-", dir=tmp_base))
    try:
        return [rounds_table(reps, root / "rounds"), exchange_table(reps, root / "exchange")]
    finally:
        if not keep:
            with contextlib.suppress(OSError):
                shutil.rmtree(root)
