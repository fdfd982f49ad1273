"""Experiment tracking's cost per round under the real scheduler: the digits job without tracking,
with MLflow's embedded SQLite store and with a real ``mlflow server``, side by side in one run.

1. **Per task** (what one tracking write costs a task process, median CPU and wall seconds): a task
   process of its own (imports MLflow, opens its store, writes one round) against one forked from
   a process that ran :func:`flare_airflow.tracking.preload_mlflow` -- what a LocalExecutor (or
   Edge/Celery) worker's task pays with the deployment default ``[flare_airflow] tracking`` and
   the preload of docs/scale.md; each on the embedded store and on the server.
2. **Real scheduler**: one Airflow (``tests.stack``: PostgreSQL, api-server, scheduler,
   dag-processor, LocalExecutor) with docs/scale.md's preload and ``[flare_airflow] tracking =
   mlflow`` set for the deployment; three DAGs of the digits demo's shape (4 process sites, 3
   rounds, evaluation on): ``tracking: false``, the deployment default (embedded), and
   ``tracking: {backend: mlflow, uri: <the server>}``. Runs alternate. Reported, medians: wall
   time per round (trigger to success / rounds), and tracking's own time inside each round's
   aggregation task from its log (the round's summary line to the line reporting the write).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from bench_common import BenchmarkFailed, Table, log, median, spread

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 3
MODES = ("off", "embedded", "server")
# One round's write, as an aggregation makes it: the run's points and 4 sites' points.
WRITE = """
def write(uri, run_id):
    from flare_airflow.tracking import MlflowWriter, RunIdentity
    writer = MlflowWriter(uri, "bench-per-task")
    with writer.session():
        writer.write(RunIdentity("bench", run_id, "bench", "file:///"),
                     {"global_accuracy": {1: 0.5}, "global_loss": {1: 0.7}, "sites_valid": {1: 4.0}},
                     {f"site-{i}": {"train_loss": {1: 0.3}, "num_samples": {1: 300.0}} for i in range(1, 5)})
"""
FRESH = (
    WRITE
    + """
import resource, sys, time
t, c = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
write(sys.argv[1], sys.argv[2])
d = resource.getrusage(resource.RUSAGE_SELF)
print(d.ru_utime + d.ru_stime - c.ru_utime - c.ru_stime, time.monotonic() - t)
"""
)
FORKED = (
    WRITE
    + """
import os, resource, sys, time
from flare_airflow.tracking import preload_mlflow
preload_mlflow()
for rep in range(int(sys.argv[3])):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        t, c = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
        write(sys.argv[1], f"{sys.argv[2]}-{rep}")
        d = resource.getrusage(resource.RUSAGE_SELF)
        os.write(w, f"{d.ru_utime + d.ru_stime - c.ru_utime - c.ru_stime} {time.monotonic() - t}\\n".encode())
        os._exit(0)
    os.close(w)
    print(os.read(r, 200).decode().strip())
    os.close(r)
    os.waitpid(pid, 0)
"""
)


def _job(dag_id: str, mode: str, server_uri: str) -> dict:
    job = yaml.safe_load((REPO / "dags" / "digits.yaml").read_text())
    job.update(job=dag_id, rounds=ROUNDS)
    job["initial_model"] = str(REPO / "examples" / "digits" / "initial_model.safetensors")
    job["trainer"]["script"] = str(REPO / "examples" / "digits" / "trainer.py")
    if mode == "off":
        job["tracking"] = False  # the deployment default tracks every job that does not say
    elif mode == "server":
        job["tracking"] = {"backend": "mlflow", "uri": server_uri}
    return job


def _stamp(line: str) -> float:
    # A worker's task log is JSON lines; `airflow dags test`'s is text starting with the time.
    text = json.loads(line)["timestamp"] if line.startswith("{") else line.split(" ", 1)[0]
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def tracking_seconds(home: Path, dag_id: str, run_id: str) -> list[float]:
    """Per round: from the aggregation's summary line to the line reporting the tracking write."""
    out = []
    for r in range(1, ROUNDS + 1):
        logs = home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id=round_{r}.global_model"
        lines = "\n".join(p.read_text() for p in sorted(logs.glob("attempt=*.log"))).splitlines()
        start = [_stamp(x) for x in lines if re.search(rf"round {r}: \d+/\d+ sites counted", x)]
        end = [_stamp(x) for x in lines if f"experiment tracking (round {r})" in x]
        if not start or not end:
            raise BenchmarkFailed(f"{dag_id} {run_id}: no tracking lines in round {r}'s aggregation log")
        out.append(end[-1] - start[-1])
    return out


def _per_task(python: str, env: dict[str, str], uris: dict[str, str], reps: int) -> Table:
    table = Table(
        "Per task: one round's tracking write (the run's points + 4 sites'), CPU and wall seconds, medians",
        ["store", "task process", "CPU s", "wall s", "runs (wall)"],
    )
    for store, uri in uris.items():
        fresh = []
        for rep in range(reps):
            out = subprocess.run([python, "-c", FRESH, uri, f"fresh-{store}-{rep}"], env=env,
                                 capture_output=True, text=True, check=True)  # fmt: skip
            fresh.append(tuple(map(float, out.stdout.split()[-2:])))
        out = subprocess.run([python, "-c", FORKED, uri, f"forked-{store}", str(reps)], env=env,
                             capture_output=True, text=True, check=True)  # fmt: skip
        forked = [tuple(map(float, line.split())) for line in out.stdout.strip().splitlines()]
        for name, rows in (("of its own (no preload)", fresh), ("forked from a preloaded worker", forked)):
            walls = [w for _, w in rows]
            table.add(store, name, f"{median([c for c, _ in rows]):.2f}", f"{median(walls):.2f}", spread(walls))
    return table


def run(*, reps: int, keep: bool, tmp_base: str | None) -> list[Table]:
    sys.path.insert(0, str(REPO))
    from bench_scale import stop_stack, write_preload

    from flare_airflow_testing.harness import BIN
    from flare_airflow_testing.mlflow_server import MlflowServer
    from flare_airflow_testing.ports import free_port
    from flare_airflow_testing.stack import AirflowStack, Postgres

    root = Path(tempfile.mkdtemp(prefix="flare-bench-tracking-", dir=tmp_base))
    server = MlflowServer(root, free_port())
    pg = stack = None
    per_round: dict[str, list[float]] = {m: [] for m in MODES}
    inside: dict[str, list[float]] = {m: [] for m in MODES if m != "off"}
    try:
        server.start()
        log(f"[tracking] mlflow server up at {server.uri}")
        env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}
        uris = {"embedded (SQLite)": f"sqlite:///{root / 'per-task.db'}", "server": server.uri}
        # The embedded store's first write creates its tables (once per store): not a task's cost.
        subprocess.run([str(BIN / "python"), "-c", WRITE + "\nimport sys\nwrite(sys.argv[1], 'create')",
                        uris["embedded (SQLite)"]], env=env, check=True, capture_output=True)  # fmt: skip
        per_task = _per_task(str(BIN / "python"), env, uris, reps)
        log("[tracking] per-task writes measured")

        pg = Postgres()
        stack = AirflowStack(root / "stack", pg.url, parallelism=4,
                             extra_env={"AIRFLOW__FLARE_AIRFLOW__TRACKING": "mlflow",
                                        # a job file's tracking.uri must be one the deployment lists
                                        "AIRFLOW__FLARE_AIRFLOW__TRACKING_URIS": server.uri})  # fmt: skip
        write_preload(stack.home)
        stack.start()
        files = {}
        for mode in MODES:
            dag_id = f"digits_{mode}"
            (stack.dags / f"{dag_id}.yaml").write_text(yaml.safe_dump(_job(dag_id, mode, server.uri)))
            (stack.dags / f"{dag_id}_dag.py").write_text(
                "from pathlib import Path\nfrom flare_airflow.builder import build_dag\n"
                f"dag = build_dag(Path(__file__).with_name('{dag_id}.yaml'))\n"
            )
            files[mode] = f"flare_{dag_id}"

        def timed(mode: str) -> tuple[float, str]:
            started = time.monotonic()
            run_id = stack.trigger(files[mode])
            state = stack.wait_for_run(files[mode], run_id, timeout=1200)
            elapsed = time.monotonic() - started
            if state != "success":
                raise BenchmarkFailed(f"{files[mode]} {run_id}: {state}; see {stack.root}")
            return elapsed, run_id

        first, _ = timed("embedded")  # creates the embedded store's tables (once per store)
        log(f"[tracking] first tracked run (creates the SQLite store): {first:.0f}s")
        for rep in range(reps):
            order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
            for mode in order:
                elapsed, run_id = timed(mode)
                per_round[mode].append(elapsed / ROUNDS)
                if mode != "off":
                    inside[mode] += tracking_seconds(stack.home, files[mode], run_id)
                log(f"[tracking] {mode}: {elapsed:.0f}s")
    finally:
        stop_stack(stack, pg)
        server.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    off = median(per_round["off"])
    sched = Table(
        f"Under the real scheduler (PostgreSQL, LocalExecutor, preloaded, `[flare_airflow] tracking = mlflow`): "
        f"digits, 4 process sites x {ROUNDS} rounds, evaluation on; medians of {reps} runs per mode",
        ["mode", "a round, s", "runs", "vs off", "tracking in the aggregation, s", "its share of a round"],
    )
    sched.add("tracking off (`tracking: false`)", f"{off:.2f}", spread(per_round["off"]), "", "", "")
    for mode, label in (("embedded", "MLflow, embedded SQLite (the default)"), ("server", "MLflow, `mlflow server`")):
        on = median(per_round[mode])
        sched.add(label, f"{on:.2f}", spread(per_round[mode]), f"{100 * (on - off) / off:+.1f} %",
                  f"{median(inside[mode]):.3f} ({spread(inside[mode], '{:.3f}')})",
                  f"{100 * median(inside[mode]) / off:.1f} %")  # fmt: skip
    sched.notes.append(
        f"The first tracked run, which creates the embedded store's tables, took {first / ROUNDS:.2f} s per round; "
        "not counted. 'vs off' compares whole rounds, which on this shared machine vary more than tracking costs; "
        "the aggregation's own tracking time is the direct measure."
    )
    return [per_task, sched]
