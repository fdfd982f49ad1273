"""Rounds a run does not ask for: a run of R of a job's M rounds against a job of exactly R rounds.

Under Airflow's real scheduler (``flare_airflow_testing.stack``: a private PostgreSQL, api-server, scheduler with
the LocalExecutor, dag-processor), two DAGs of the same job shape -- 2 process sites, the no-op
trainer, ``evaluate: false`` -- one with M rounds triggered with ``{"rounds": R}``, one with exactly R
rounds. Runs alternate; each is timed from the trigger to the run's end, and the task instances of
rounds beyond R are counted by whether they ever started (a task process of their own) or were
skipped without one. The goal: R of M costs no more than R rounds plus a constant.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import BenchmarkFailed, Table, log, median, spread
from bench_scale import TRAINER, stop_stack, write_init_model

REPO = Path(__file__).resolve().parent.parent
SITES = 2
CASES = ((2, 8), (1, 8))  # (R rounds asked for, M rounds in the job)
PARALLELISM = 4


def write_job(folder: Path, dag_id: str, rounds: int, init: Path) -> None:
    job = {
        "job": dag_id.replace("_", "-"),
        "rounds": rounds,
        "min_clients": SITES,
        "initial_model": str(init),
        "trainer": {"script": str(TRAINER)},
        "evaluate": False,
        "sites": {f"site-{i}": {} for i in range(1, SITES + 1)},
    }
    (folder / f"{dag_id}.yaml").write_text(json.dumps(job, indent=1) + "\n")
    (folder / f"{dag_id}_dag.py").write_text(
        f'"""Rounds benchmark: {SITES} sites x {rounds} rounds."""\n'
        "from pathlib import Path\n\n"
        "from flare_airflow.builder import build_dag\n\n"
        f'dag = build_dag(Path(__file__).with_name("{dag_id}.yaml"), dag_id="{dag_id}")\n'
    )


def timed_run(stack: Any, dag_id: str, conf: dict[str, Any], beyond: int) -> tuple[float, int, int]:
    """Seconds from trigger to end; task instances of rounds > ``beyond`` that started / were skipped unstarted."""
    started = time.monotonic()
    run_id = stack.trigger(dag_id, conf)
    state = stack.wait_for_run(dag_id, run_id, timeout=600)
    elapsed = time.monotonic() - started
    tis = stack.task_instances(dag_id, run_id)
    if state != "success":
        bad = {t: ti["state"] for t, ti in tis.items() if ti["state"] not in ("success", "skipped")}
        raise BenchmarkFailed(f"{dag_id} run {run_id}: {state}; {bad}")
    later = [ti for t, ti in tis.items() if t.startswith("round_") and int(t.split(".")[0][6:]) > beyond]
    ran = sum(1 for ti in later if ti.get("hostname"))  # a task process of its own ran it
    return elapsed, ran, len(later) - ran


def run(*, reps: int, quick: bool, keep: bool, tmp_base: str | None) -> list[Table]:
    import tempfile

    sys.path.insert(0, str(REPO))
    from flare_airflow_testing.stack import AirflowStack, Postgres

    root = Path(tempfile.mkdtemp(prefix="flare-bench-rounds-", dir=tmp_base))
    init = write_init_model(root / "init.safetensors")
    cases = CASES[:1] if quick else CASES
    pg = stack = None
    times: dict[str, list[float]] = {}
    skipped: dict[str, tuple[int, int]] = {}
    try:
        pg = Postgres()
        stack = AirflowStack(root / "stack", pg.url, parallelism=PARALLELISM)
        for r, m in cases:
            write_job(stack.dags, f"rounds_{m}", m, init)
            write_job(stack.dags, f"rounds_{r}", r, init)
        stack.start()
        log("[rounds] PostgreSQL + Airflow up")
        for rep in range(reps):
            for r, m in cases:
                pair = [(f"rounds_{m}", {"rounds": r}, f"{r} of {m}"), (f"rounds_{r}", {}, f"{r} of {r}")]
                for dag_id, conf, label in pair if rep % 2 == 0 else pair[::-1]:
                    elapsed, ran, unstarted = timed_run(stack, dag_id, conf, r)
                    times.setdefault(label, []).append(elapsed)
                    if conf:
                        skipped[label] = (ran, unstarted)
                    log(f"[rounds] {label} rounds: {elapsed:.1f}s")
    finally:
        stop_stack(stack, pg)
        if not keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    table = Table(
        f"A run of R of M rounds vs a job of exactly R rounds, real scheduler (LocalExecutor, parallelism "
        f"{PARALLELISM}, PostgreSQL), {SITES} process sites, no-op trainer; trigger to end, median of {reps}",
        [
            "run",
            "wall (s)",
            "runs",
            "R of M minus R of R (s)",
            "tasks of rounds > R: ran a task process / skipped without one",
        ],
    )
    for r, m in cases:
        ours, exact = times[f"{r} of {m}"], times[f"{r} of {r}"]
        ran, unstarted = skipped[f"{r} of {m}"]
        table.add(
            f"{r} of {m} rounds",
            f"{median(ours):.1f}",
            spread(ours, "{:.1f}"),
            f"{median(ours) - median(exact):+.1f}",
            f"{ran} / {unstarted}",
        )
        table.add(f"{r} of {r} rounds", f"{median(exact):.1f}", spread(exact, "{:.1f}"), "", "")
    return [table]
