"""End-to-end benchmark: a trivial federated job through real Airflow (embedded default, SQLite).

Everything runs in a temporary AIRFLOW_HOME with its own dags folder holding three DAGs:

* ``bench_floor``: one no-op ``PythonOperator`` -- Airflow's fixed cost of ``airflow dags test``;
* ``bench_r1`` / ``bench_r3``: the same job (2 sites, no-op trainer, ``evaluate: false``) built
  with :func:`flare_airflow.builder.build_dag`, with 1 and with 3 rounds.

The three are run alternately (order rotated each repetition); ``(t3 - t1) / 2`` is the cost of one
round, measured side by side in the same run. Every run's task states are checked: a task that is
not ``success`` aborts the benchmark.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import BenchmarkFailed, Table, log, median, rotate, spread

BENCH_DIR = Path(__file__).resolve().parent
TRAINER = BENCH_DIR / "noop_trainer.py"
SITES = ("site-1", "site-2")
FLOOR_DAG = "bench_floor"
RUN_TIMEOUT = 600


@dataclass(frozen=True)
class DagCase:
    dag_id: str
    label: str
    rounds: int  # 0 for the floor DAG

    def expected_tasks(self) -> set[str]:
        if self.rounds == 0:
            return {"noop"}
        tasks = {"prepare", "publish"}
        for r in range(1, self.rounds + 1):
            tasks |= {f"round_{r}.{site}" for site in SITES} | {f"round_{r}.global_model"}
        return tasks


CASES = (
    DagCase(FLOOR_DAG, "floor: 1 no-op PythonOperator", 0),
    DagCase("bench_r1", "job: 2 sites x 1 round", 1),
    DagCase("bench_r3", "job: 2 sites x 3 rounds", 3),
)
TASKS_PER_ROUND = len(SITES) + 1  # the site tasks and the round's global_model (FedAvg) task


@dataclass
class RunResult:
    dag_id: str
    dags_test_seconds: float  # wall time of the `airflow dags test` process
    total_seconds: float  # wall time of the whole command (with `flare-airflow run`: + start-up, state check, exit)
    log: Path
    phases: dict[str, float] = field(default_factory=dict)
    tasks: list[tuple[str, float]] = field(default_factory=list)  # (task_id, seconds) in run order
    round_seconds: float | None = None  # one round's span in Airflow's log (mean of rounds 2..R)


def airflow_env(home: Path, dags: Path) -> dict[str, str]:
    """The embedded default: no inherited Airflow settings, a private home (SQLite) and dags folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "PYTHONWARNINGS": "ignore::DeprecationWarning",
        }
    )
    return env


def write_dags(dags: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    dags.mkdir(parents=True, exist_ok=True)
    save_file(
        {"weight": np.zeros((16, 16), np.float32), "bias": np.zeros(16, np.float32)}, str(dags / "init.safetensors")
    )
    for case in CASES[1:]:
        job = {
            "job": case.dag_id.replace("_", "-"),
            "rounds": case.rounds,
            "min_clients": len(SITES),
            "initial_model": "init.safetensors",
            "trainer": {"script": str(TRAINER)},
            "evaluate": False,
            "sites": {site: {} for site in SITES},
        }
        (dags / f"{case.dag_id}.yaml").write_text(json.dumps(job, indent=2) + "\n")  # JSON is YAML
        (dags / f"{case.dag_id}_dag.py").write_text(
            textwrap.dedent(
                f'''\
                """Benchmark job DAG ({case.label}), built by flare_airflow.builder.build_dag."""
                from pathlib import Path

                from flare_airflow.builder import build_dag

                dag = build_dag(Path(__file__).with_name("{case.dag_id}.yaml"), dag_id="{case.dag_id}")
                '''
            )
        )
    (dags / f"{FLOOR_DAG}_dag.py").write_text(
        textwrap.dedent(
            f'''\
            """Airflow's floor: one no-op task (what `airflow dags test` costs whatever the DAG does)."""
            from airflow.providers.standard.operators.python import PythonOperator
            from airflow.sdk import DAG


            def noop() -> None:
                return None


            with DAG(dag_id="{FLOOR_DAG}", schedule=None, catchup=False) as dag:
                PythonOperator(task_id="noop", python_callable=noop)
            '''
        )
    )


def migrate(env: dict[str, str], home: Path) -> float:
    home.mkdir(parents=True, exist_ok=True)
    log = home / "db-migrate.log"
    started = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "airflow", "db", "migrate"],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=RUN_TIMEOUT,
            check=False,
        )
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        raise BenchmarkFailed(f"`airflow db migrate` exited {proc.returncode}; see {log}")
    return elapsed


def _states_from_db(home: Path, dag_id: str) -> tuple[str, str, dict[str, str]]:
    """(run_id, run state, task states) of the latest run, read from the SQLite metadata DB."""
    con = sqlite3.connect(f"file:{home / 'airflow.db'}?mode=ro", uri=True)
    try:
        row = con.execute(
            "SELECT run_id, state FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1", (dag_id,)
        ).fetchone()
        if row is None:
            raise BenchmarkFailed(f"no run of {dag_id} in the metadata database")
        tis = con.execute(
            "SELECT task_id, state FROM task_instance WHERE dag_id = ? AND run_id = ?", (dag_id, row[0])
        ).fetchall()
    finally:
        con.close()
    return str(row[0]), str(row[1]), {str(t): str(s) for t, s in tis}


# How `flare-airflow run` worked before issue 5's cuts (its code at 5ce5671, minus printing): its own
# process starts `airflow dags test` as a subprocess, then imports Airflow to read the run's states.
# Run with a virtual environment installed without compiled bytecode, it is the "before" of the
# before/after comparison (see bench_nvflare).
LEGACY_RUN = """
import json, subprocess, sys, time
from flare_airflow.cli.dag_runs import run_state
dag_id, log_path = sys.argv[1], sys.argv[2]
started = time.monotonic()
with open(log_path, "w") as log:
    proc = subprocess.run([sys.executable, "-m", "airflow", "dags", "test", dag_id], stdout=log,
                          stderr=subprocess.STDOUT, check=False)
elapsed = time.monotonic() - started
state = run_state(dag_id)
state["wall_seconds"] = round(elapsed, 2)
print(json.dumps(state))
sys.exit(proc.returncode)
"""


class Runner:
    """Runs the benchmark DAGs and checks each run's final task states.

    ``legacy``: run them the way ``flare-airflow run`` did before issue 5 (:data:`LEGACY_RUN`),
    with ``python`` (another virtual environment's interpreter).
    """

    def __init__(self, root: Path, *, via_cli: bool, python: str = sys.executable, legacy: bool = False) -> None:
        self.root = root
        self.home = root / "home"
        self.dags = root / "dags"
        self.logs = root / "logs"
        self.env = airflow_env(self.home, self.dags)
        self.via_cli = via_cli or legacy
        self.python = python
        self.legacy = legacy
        self.seen_runs: set[str] = set()
        self.count = 0

    def run(self, case: DagCase) -> RunResult:
        self.count += 1
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{self.count:02d}-{case.dag_id}.log"
        started = time.monotonic()
        if self.via_cli:
            # The product path: `flare-airflow run` wraps `airflow dags test` and checks every task.
            cmd = [self.python, "-m", "flare_airflow.cli", "run", case.dag_id, "--json", "--log", str(log)]
            if self.legacy:
                cmd = [self.python, "-c", LEGACY_RUN, case.dag_id, str(log)]
            proc = subprocess.run(
                cmd, env=self.env, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False, cwd=self.root
            )
            total = time.monotonic() - started
            # Take the JSON object (older versions of the CLI printed a "running ..." line before it on stdout).
            start = proc.stdout.find("\n{")
            text = proc.stdout[start + 1 :] if start >= 0 else proc.stdout
            try:
                state = json.loads(text)
            except json.JSONDecodeError:
                raise BenchmarkFailed(
                    f"{case.dag_id}: `flare-airflow run` exited {proc.returncode} without a JSON state "
                    f"(stderr: {proc.stderr.strip()[-2000:]}); Airflow log: {log}"
                ) from None
            run_id, run_state = state["run_id"], state["state"]
            tasks = {t: i["state"] for t, i in state["tasks"].items()}
            dags_test = float(state["wall_seconds"])
            returncode = proc.returncode
        else:
            # `airflow dags test` exits 0 even when a task failed: read the states from the DB.
            with log.open("w") as fh:
                proc2 = subprocess.run(
                    [sys.executable, "-m", "airflow", "dags", "test", case.dag_id],
                    env=self.env,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    timeout=RUN_TIMEOUT,
                    check=False,
                    cwd=self.root,
                )
            dags_test = time.monotonic() - started
            run_id, run_state, tasks = _states_from_db(self.home, case.dag_id)
            total = time.monotonic() - started
            returncode = proc2.returncode
        if run_id in self.seen_runs:
            raise BenchmarkFailed(
                f"{case.dag_id}: the command exited {returncode} and created no new run (it failed before running "
                f"the DAG). Airflow log: {log}"
            )
        bad = {t: s for t, s in tasks.items() if s != "success"}
        missing = case.expected_tasks() - set(tasks)
        if returncode != 0 or run_state != "success" or bad or missing:
            raise BenchmarkFailed(
                f"{case.dag_id}: run {run_id} is {run_state!r} (exit code {returncode}); tasks not successful: "
                f"{bad or 'none'}; missing tasks: {sorted(missing) or 'none'}. Airflow log: {log}"
            )
        self.seen_runs.add(run_id)
        result = RunResult(case.dag_id, dags_test, total, log)
        parse_log(result)
        return result


_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z ")
_START = re.compile(r"\[DAG TEST\] starting task_id=(\S+)")
_END = re.compile(r"\[DAG TEST\] end task task_id=(\S+)")


def _ts(text: str) -> float:
    return datetime.datetime.fromisoformat(text).replace(tzinfo=datetime.UTC).timestamp()


def parse_log(result: RunResult) -> None:
    """Split a run's wall time into phases using the timestamps in Airflow's own log."""
    first = last = first_start = None
    starts: dict[str, float] = {}
    spans: dict[int, list[float]] = {}  # round -> [first start, last end]
    for line in result.log.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        ts = _ts(m.group(1))
        first = ts if first is None else first
        last = ts
        if s := _START.search(line):
            starts[s.group(1)] = ts
            first_start = ts if first_start is None else first_start
        elif e := _END.search(line):
            task = e.group(1)
            if task in starts:
                began = starts.pop(task)
                result.tasks.append((task, ts - began))
                if r := re.match(r"round_(\d+)\.", task):
                    span = spans.setdefault(int(r.group(1)), [began, ts])
                    span[0], span[1] = min(span[0], began), max(span[1], ts)
    if first is None or last is None or first_start is None or not result.tasks:
        raise BenchmarkFailed(f"cannot find Airflow's [DAG TEST] task lines in {result.log}")
    task_total = sum(d for _, d in result.tasks)
    if len(spans) >= 2:
        # From the first task of round 2 to the last of the final round: whole rounds, gaps included,
        # none of them carrying Airflow's start-up (which lands on the first task, `prepare`).
        rounds = sorted(spans)[1:]
        result.round_seconds = (spans[rounds[-1]][1] - spans[rounds[0]][0]) / len(rounds)
    result.phases = {
        "outside": result.dags_test_seconds - (last - first),
        "prepare_run": first_start - first,
        "first_task": result.tasks[0][1],
        "other_tasks": task_total - result.tasks[0][1],
        "between": (last - first_start) - task_total,
    }


def task_kind(task_id: str) -> str:
    if task_id == "noop":
        return "no-op PythonOperator (floor DAG)"
    if task_id in ("prepare", "publish"):
        return {"prepare": "prepare (round-0 model)", "publish": "publish (final model, metrics.json, plot)"}[task_id]
    if task_id.endswith(".global_model"):
        return "global_model (FedAvg of 2 tiny updates, write)"
    return "site task (bash -> site_runner -> trainer)"


# --- a site job outside Airflow: what one site task costs before Airflow adds anything ---------------


def noop_site_run(work: Path, site: str, output: Path) -> Any:
    """A :class:`SiteRun` of the no-op trainer on a 16x16 global model written under ``work`` (once)."""
    import numpy as np

    from flare_airflow.core.model import FLModel, write_artifact
    from flare_airflow.site_task.spec import SiteRun

    global_model = work / "global.safetensors"
    if not global_model.exists():
        write_artifact(
            global_model,
            FLModel(params={"weight": np.zeros((16, 16), np.float32), "bias": np.zeros(16, np.float32)}),
        )
    return SiteRun(
        job="bench",
        run_id="bench",
        round=1,
        total_rounds=1,
        site=site,
        task="train",
        argv=[sys.executable, str(TRAINER)],
        global_model=str(global_model),
        output=str(output),
    )


def site_job_outside_airflow(root: Path, reps: int) -> Table:
    from flare_airflow.site_task.spec import SPEC_ENV

    work = root / "site-job"
    spec = noop_site_run(work, "site-1", work / "site-runner.safetensors")
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
    # The trainer alone gets the variables the runner would give it (SiteRun.site_job's).
    alone = noop_site_run(work, "site-1", work / "trainer-alone.safetensors")
    trainer_env = {**base_env, **alone.site_job().env}
    cases: list[tuple[str, list[str], dict[str, str]]] = [
        ("`python -c pass` (interpreter start)", [sys.executable, "-c", "pass"], base_env),
        (
            "`python -c 'import flare_airflow.client'` (numpy + safetensors)",
            [sys.executable, "-c", "import flare_airflow.client"],
            base_env,
        ),
        ("no-op trainer alone: receive() + send()", [sys.executable, str(TRAINER)], trainer_env),
        (
            "`python -m flare_airflow.site_task` (runs the trainer, verifies its update)",
            [sys.executable, "-m", "flare_airflow.site_task"],
            {**base_env, SPEC_ENV: spec.to_json()},
        ),
        ("`bash -c 'exec true'` (what BashOperator adds)", ["bash", "-c", "exec true"], base_env),
    ]
    times: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    for rep in range(reps):
        for label, argv, env in rotate(cases, rep):
            started = time.monotonic()
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
            times[label].append(time.monotonic() - started)
            if proc.returncode != 0:
                raise BenchmarkFailed(f"{label} exited {proc.returncode}: {proc.stdout[-1000:]}{proc.stderr[-1000:]}")
    table = Table(
        "What one site task runs, timed outside Airflow (processes only, no scheduler)",
        ["command", "median s", "min-max s"],
    )
    for label, _, _ in cases:
        table.add(label, f"{median(times[label]):.3f}", spread(times[label], "{:.3f}"))
    table.notes.append(
        "A site task is a BashOperator running `exec python -m flare_airflow.site_task`, which starts the "
        "trainer as a second Python process: two interpreter starts importing numpy (the runner starts the trainer "
        "first and loads numpy while it runs, so the two overlap on the 2 cores), plus reading and verifying the "
        "update once more after the trainer exits."
    )
    return table


# --- the benchmark ----------------------------------------------------------------------------------


def run(*, reps: int, quick: bool, keep: bool, tmp_base: str | None) -> list[Table]:
    root = Path(tempfile.mkdtemp(prefix="flare-bench-e2e-", dir=tmp_base))
    runner = Runner(root, via_cli=not quick)
    ok = False
    try:
        log(f"[e2e] temporary AIRFLOW_HOME {runner.home}, dags folder {runner.dags}")
        write_dags(runner.dags)
        migrate_s = migrate(runner.env, runner.home)
        log(f"[e2e] airflow db migrate: {migrate_s:.1f}s")
        cold: dict[str, RunResult] = {}
        if not quick:
            # One untimed pass first: the first run of a DAG also serialises it into the fresh DB.
            for case in CASES:
                cold[case.dag_id] = runner.run(case)
                log(f"[e2e] first run of {case.dag_id}: {cold[case.dag_id].dags_test_seconds:.1f}s")
        results: dict[str, list[RunResult]] = {c.dag_id: [] for c in CASES}
        for rep in range(reps):
            for case in rotate(CASES, rep):
                res = runner.run(case)
                results[case.dag_id].append(res)
                log(f"[e2e] rep {rep + 1}/{reps} {case.dag_id}: airflow dags test {res.dags_test_seconds:.2f}s")
        site_table = site_job_outside_airflow(root, reps)
        ok = True
    finally:
        if keep or not ok:
            log(f"[e2e] kept {root} (Airflow logs under {runner.logs})")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return [*_tables(results, cold, migrate_s, reps, quick), site_table]


def _tables(
    results: dict[str, list[RunResult]], cold: dict[str, RunResult], migrate_s: float, reps: int, quick: bool
) -> list[Table]:
    wall = {d: [r.dags_test_seconds for r in rs] for d, rs in results.items()}
    total = {d: [r.total_seconds for r in rs] for d, rs in results.items()}
    how = (
        "`airflow dags test` run directly, task states read from the SQLite metadata DB (--quick)"
        if quick
        else "`flare-airflow run DAG --json` (runs `airflow dags test` in-process, then reads every task's state)"
    )
    main = Table(
        "Wall time of one run (embedded default: SQLite, `airflow dags test`)",
        ["DAG", "tasks", "`airflow dags test` s (median)", "min-max", "whole command s"]
        + ([] if quick else ["first run after migrate s"]),
    )
    for case in CASES:
        row = [
            f"`{case.dag_id}` — {case.label}",
            str(len(case.expected_tasks())),
            f"{median(wall[case.dag_id]):.2f}",
            spread(wall[case.dag_id]),
            f"{median(total[case.dag_id]):.2f}",
        ]
        if not quick:
            row.append(f"{cold[case.dag_id].dags_test_seconds:.2f}")
        main.add(*row)
    main.notes += [
        f"Executed with {how}; {reps} repetitions, the three DAGs alternating (order rotated each repetition); "
        "every run checked: all tasks `success`. "
        f"One-time setup `airflow db migrate`: {migrate_s:.1f} s. "
        "Job: 2 process sites, no-op trainer (receive the 16x16 model, send it back with num_samples), "
        "`evaluate: false`; a round is 2 site tasks + 1 `global_model` task.",
    ]
    if not quick:
        main.notes.append(
            "'whole command' adds the interpreter's start, importing Airflow, `flare-airflow run`'s state check "
            "(same process, same import) and the exit; `airflow dags test` s is the in-process command alone."
        )

    f, t1, t3 = (wall[c.dag_id] for c in CASES)
    per_round = [(b - a) / 2 for a, b in zip(t1, t3, strict=True)]
    round_m = (median(t3) - median(t1)) / 2
    logged = [r.round_seconds for r in results[CASES[2].dag_id] if r.round_seconds is not None]
    over_floor = [a - fl for fl, a in zip(f, t1, strict=True)]
    derived = Table(
        "Airflow's fixed cost vs ours (from the runs above, paired by repetition)",
        ["quantity", "median s", "min-max s"],
    )
    derived.add("Airflow floor: `airflow dags test` of a 1-task no-op DAG", f"{median(f):.2f}", spread(f))
    derived.add(
        "1-round job minus the floor (prepare, 3 round tasks, publish)", f"{median(over_floor):.2f}", spread(over_floor)
    )
    derived.add(
        "**per round: (t3 - t1) / 2** (medians; min-max of the per-repetition pairs)",
        f"**{round_m:.2f}**",
        spread(per_round),
    )
    derived.add(
        f"**per task: per round / {TASKS_PER_ROUND} tasks**",
        f"**{round_m / TASKS_PER_ROUND:.3f}**",
        spread([p / TASKS_PER_ROUND for p in per_round], "{:.3f}"),
    )
    derived.add(
        "cross-check, per round from Airflow's log of the 3-round runs (rounds 2-3, gaps included)",
        f"{median(logged):.2f}",
        spread(logged),
    )
    share = [fl / b for fl, b in zip(f, t3, strict=True)]
    derived.add("share of the 3-round job that is the floor", f"{100 * median(share):.0f} %", "")

    phases = Table(
        "Where a run's time goes (timestamps from Airflow's own log; medians)",
        ["phase", *(f"`{c.dag_id}` s" for c in CASES)],
    )
    labels = {
        "outside": "before Airflow's first log line + after its last (interpreter start, import, exit)",
        "prepare_run": "load config, parse the dags folder, serialise the DAG, create the run",
        "first_task": "first task (includes Airflow's one-time in-process execution-API start-up)",
        "other_tasks": "all other tasks",
        "between": "between tasks (the `dags test` scheduling loop)",
    }
    for key, label in labels.items():
        phases.add(label, *(f"{median([r.phases[key] for r in results[c.dag_id]]):.2f}" for c in CASES))

    kinds: dict[str, list[float]] = {}
    for rs in results.values():
        for res in rs:
            for task, seconds in res.tasks[1:]:  # the first task carries Airflow's start-up
                kinds.setdefault(task_kind(task), []).append(seconds)
    first = [r.tasks[0][1] for rs in results.values() for r in rs]
    per_kind = Table(
        "Per task, from '[DAG TEST] starting' to 'end task' (all runs above)",
        ["task", "count", "median s", "min-max s"],
    )
    per_kind.add(
        "first task of a run (`noop` or `prepare`, with Airflow's start-up)",
        len(first),
        f"{median(first):.2f}",
        spread(first),
    )
    for kind, values in sorted(kinds.items()):
        per_kind.add(kind, len(values), f"{median(values):.3f}", spread(values, "{:.3f}"))
    return [main, derived, phases, per_kind]
