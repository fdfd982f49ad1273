"""Experiment tracking's cost per round: the digits job with MLflow tracking (embedded SQLite store)
against the same job without it, side by side.

Two DAGs of the digits demo's shape (4 process sites, 3 rounds, evaluation on) differ only in
``tracking: {backend: mlflow}``; they run through ``flare-airflow run`` (``airflow dags test`` on
SQLite, the embedded default). A first tracked run creates the SQLite store (once per store) and
is reported apart; then the runs alternate. Reported, medians of the repetitions:

- wall time per round, tracking off and on;
- tracking's own time inside each round's aggregation task, from the task log (the line after
  the round's summary to the line that reports the write);
- what a task pays in a fresh process, as under the real scheduler where every task is a process
  of its own (``dags test`` runs its tasks in one process, which imports MLflow once per run):
  a new Python process that imports the writer and writes one round to the same store.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from bench_common import BenchmarkFailed, Table, log, median, spread

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 3
FRESH_WRITE = """
import sys, time
t = time.monotonic()
from flare_airflow.tracking import MlflowWriter, RunIdentity
writer = MlflowWriter(sys.argv[1], "digits-on")
with writer.session():
    writer.write(RunIdentity("bench", sys.argv[2], "digits-on", "file:///"), {"global_accuracy": {1: 0.5}},
                 {f"site-{i}": {"train_loss": {1: 0.3}} for i in range(1, 5)})
print(time.monotonic() - t)
"""


def _job(dag_id: str, tracking: bool) -> dict:
    job = yaml.safe_load((REPO / "dags" / "digits.yaml").read_text())
    job.update(job=dag_id, rounds=ROUNDS)
    job["initial_model"] = str(REPO / "examples" / "digits" / "initial_model.safetensors")
    job["trainer"]["script"] = str(REPO / "examples" / "digits" / "trainer.py")
    if tracking:
        job["tracking"] = {"backend": "mlflow"}
    return job


def _stamp(line: str) -> float:
    return datetime.datetime.fromisoformat(line.split(" ", 1)[0].replace("Z", "+00:00")).timestamp()


def tracking_seconds(home: Path, dag_id: str, run_id: str) -> list[float]:
    """Per round: from the aggregation's summary line to the line reporting the tracking write."""
    out = []
    for r in range(1, ROUNDS + 1):
        logs = home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id=round_{r}.global_model"
        lines = "\n".join(p.read_text() for p in sorted(logs.glob("attempt=*.log"))).splitlines()
        start = [_stamp(x) for x in lines if re.search(rf"\] round {r}: \d+/\d+ sites counted", x)]
        end = [_stamp(x) for x in lines if f"experiment tracking (round {r})" in x]
        if not start or not end:
            raise BenchmarkFailed(f"{dag_id} {run_id}: no tracking lines in round {r}'s aggregation log")
        out.append(end[-1] - start[-1])
    return out


def run(*, reps: int, keep: bool, tmp_base: str | None) -> list[Table]:
    sys.path.insert(0, str(REPO))
    from flare_airflow_testing.harness import BIN, AirflowHome

    root = Path(tempfile.mkdtemp(prefix="flare-bench-tracking-", dir=tmp_base))
    home = AirflowHome(root)
    files = {mode: home.write_job(f"digits_{mode}", _job(f"digits_{mode}", mode == "on")) for mode in ("off", "on")}
    per_round: dict[str, list[float]] = {"off": [], "on": []}
    inside: list[float] = []

    def timed(mode: str) -> tuple[float, str]:
        started = time.monotonic()
        result = home.run(f"flare_digits_{mode}", files[mode])
        elapsed = time.monotonic() - started
        if result.state["state"] != "success":
            raise BenchmarkFailed(f"digits_{mode}: {result.state['state']}; {result.tasks}")
        return elapsed, result.state["run_id"]

    first, _ = timed("on")
    log(f"[tracking] first tracked run (creates the SQLite store): {first:.1f}s")
    for rep in range(reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            elapsed, run_id = timed(mode)
            per_round[mode].append(elapsed / ROUNDS)
            if mode == "on":
                inside += tracking_seconds(home.home, "flare_digits_on", run_id)
            log(f"[tracking] {mode}: {elapsed:.1f}s")
    db = f"sqlite:///{home.store / 'mlflow.db'}"
    fresh = []
    for rep in range(reps):
        out = subprocess.run(
            [str(BIN / "python"), "-c", FRESH_WRITE, db, f"fresh-{rep}"],
            env=home.env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        fresh.append(float(out.stdout.strip().splitlines()[-1]))
    if not keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    off = median(per_round["off"])
    table = Table(
        f"Digits (4 process sites x {ROUNDS} rounds, evaluation on) with and without MLflow tracking (embedded "
        f"SQLite), `flare-airflow run` (dags test); medians of {reps} runs",
        ["measure", "seconds", "runs", "share of a round without tracking"],
    )
    table.add("a round, tracking off", f"{off:.2f}", spread(per_round["off"]), "")
    on = median(per_round["on"])
    table.add("a round, tracking on", f"{on:.2f}", spread(per_round["on"]), f"{100 * (on - off) / off:+.1f} %")
    table.add("tracking inside the aggregation (task log)", f"{median(inside):.3f}", spread(inside, "{:.3f}"),
              f"{100 * median(inside) / off:.1f} %")  # fmt: skip
    table.add("a fresh process: import + one round's write", f"{median(fresh):.2f}", spread(fresh),
              f"{100 * median(fresh) / off:.1f} %")  # fmt: skip
    table.notes.append(
        f"The first tracked run, which creates the SQLite store, took {first / ROUNDS:.2f} s per round; not counted."
    )
    return [table]
