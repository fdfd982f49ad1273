"""Experiment tracking's cost per round: the digits job with MLflow tracking (embedded SQLite store)
against the same job without it, under Airflow's real scheduler (``tests.stack``: a private
PostgreSQL, api-server, scheduler with the LocalExecutor, dag-processor).

Two DAGs of the digits demo's shape (4 process sites, 3 rounds, evaluation on) differ only in
``tracking: {backend: mlflow}``. A first tracked run creates the SQLite store (once per store) and
is reported apart; then the runs alternate. Reported: trigger-to-end wall time per round, and the
aggregation task's own duration (where tracking runs: one import of MLflow and the writes per
round), medians of the repetitions.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from bench_common import BenchmarkFailed, Table, log, median, spread
from bench_scale import descendants

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 3
PARALLELISM = 4


def write_job(folder: Path, dag_id: str, tracking: bool) -> None:
    job = yaml.safe_load((REPO / "dags" / "digits.yaml").read_text())
    job.update(job=dag_id.replace("_", "-"), rounds=ROUNDS)
    job["initial_model"] = str(REPO / "examples" / "digits" / "initial_model.safetensors")
    job["trainer"]["script"] = str(REPO / "examples" / "digits" / "trainer.py")
    if tracking:
        job["tracking"] = {"backend": "mlflow"}
    (folder / f"{dag_id}.yaml").write_text(yaml.safe_dump(job))
    (folder / f"{dag_id}_dag.py").write_text(
        "from pathlib import Path\n\n"
        "from flare_airflow.builder import build_dag\n\n"
        f'dag = build_dag(Path(__file__).with_name("{dag_id}.yaml"), dag_id="{dag_id}")\n'
    )


def timed_run(stack: Any, dag_id: str) -> tuple[float, list[float]]:
    """Seconds from trigger to end, and each round's aggregation task duration."""
    started = time.monotonic()
    run_id = stack.trigger(dag_id, {})
    state = stack.wait_for_run(dag_id, run_id, timeout=900)
    elapsed = time.monotonic() - started
    tis = stack.task_instances(dag_id, run_id)
    if state != "success":
        raise BenchmarkFailed(f"{dag_id} run {run_id}: {state}; { ({t: ti['state'] for t, ti in tis.items()}) }")
    aggregations = [float(ti["duration"]) for t, ti in tis.items() if t.endswith(".global_model")]
    return elapsed, aggregations


def run(*, reps: int, keep: bool, tmp_base: str | None) -> list[Table]:
    import tempfile

    sys.path.insert(0, str(REPO))
    from tests.stack import AirflowStack, Postgres

    root = Path(tempfile.mkdtemp(prefix="flare-bench-tracking-", dir=tmp_base))
    pg = stack = None
    walls: dict[str, list[float]] = {"off": [], "on": []}
    aggs: dict[str, list[float]] = {"off": [], "on": []}
    first: tuple[float, list[float]] | None = None
    try:
        pg = Postgres()
        stack = AirflowStack(root / "stack", pg.url, parallelism=PARALLELISM)
        write_job(stack.dags, "digits_off", tracking=False)
        write_job(stack.dags, "digits_on", tracking=True)
        stack.start()
        log("[tracking] PostgreSQL + Airflow up")
        first = timed_run(stack, "digits_on")
        log(f"[tracking] first tracked run (creates the SQLite store): {first[0]:.1f}s")
        for rep in range(reps):
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                elapsed, agg = timed_run(stack, f"digits_{mode}")
                walls[mode].append(elapsed / ROUNDS)
                aggs[mode].append(median(agg))
                log(f"[tracking] {mode}: {elapsed:.1f}s, aggregation {median(agg):.2f}s")
    finally:
        if stack is not None:
            tree = descendants([p.pid for p in stack.procs])
            stack.stop()
            for pid in tree:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if pg is not None:
            pg.stop()
        if not keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    table = Table(
        f"Digits (4 process sites x {ROUNDS} rounds, evaluation on) with and without MLflow tracking "
        f"(embedded SQLite), real scheduler (LocalExecutor, parallelism {PARALLELISM}, PostgreSQL); "
        f"medians of {reps}",
        ["tracking", "per round, trigger to end (s)", "runs", "aggregation task (s)", "runs"],
    )
    for mode in ("off", "on"):
        table.add(
            mode, f"{median(walls[mode]):.2f}", spread(walls[mode]), f"{median(aggs[mode]):.2f}", spread(aggs[mode])
        )
    cost = median(walls["on"]) - median(walls["off"])
    table.add(
        "cost of tracking",
        f"{cost:+.2f} ({100 * cost / median(walls['off']):+.0f} % of a round)",
        "",
        f"{median(aggs['on']) - median(aggs['off']):+.2f}",
        "",
    )
    if first is not None:
        table.notes.append(
            f"The first tracked run, which creates the SQLite store, took {first[0] / ROUNDS:.2f} s per round "
            f"(aggregation {median(first[1]):.2f} s); not counted above."
        )
    return [table]
