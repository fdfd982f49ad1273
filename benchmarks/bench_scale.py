"""Scale benchmark: DAG parse cost and one round under Airflow's real scheduler, for 64-1024 sites.

Two parts, both with the no-op trainer (``noop_trainer.py``) and ``evaluate: false``:

1. **Parse.** For 64, 256 and 1024 process sites, with 1 and with 3 rounds, a fresh interpreter per
   repetition times ``import flare_airflow.builder`` (which imports the Airflow SDK), ``build_dag``,
   Airflow's ``DagSerialization.to_dict`` + ``json.dumps`` (what the dag-processor stores) and then
   ``BundleDagBag(<dag file>)`` -- Airflow's own loader, the code path of ``airflow dags list-import-errors
   --local``, of the dag-processor and of every task's start-up (the Task SDK re-parses the DAG file in
   each task process), and the same parse as a site task's process makes it (Airflow's parsing context
   naming the task). The serialized DAG's bytes and serialize time per task.
2. **One round with the real scheduler.** ``flare_airflow_testing.stack``: a private PostgreSQL, api-server, scheduler
   (LocalExecutor, ``core.parallelism`` = 16, see docs/scale.md) and dag-processor, with docs/scale.md's
   ``airflow_local_settings.py`` (the provider preloaded); the full set also runs 256 sites on a stack
   without it. One DAG file at a time is put in the dags folder; the benchmark waits until the
   dag-processor has serialised it, triggers a 1-round run and waits (bounded) for it. The biggest job
   is stopped after a fixed budget and reported as far as it got.
   CPU time is read per component from ``/proc`` (each component runs in its own session; a session's
   live processes' own plus reaped children's CPU is everything it ever ran), so "CPU seconds per site
   task" shows whether Airflow or our per-task processes are the limit on these 2 cores. The per-task
   cost of our own processes (bash -> site_runner -> trainer) is measured outside Airflow next to it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_e2e
from bench_common import BenchmarkFailed, Table, log, median, spread

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
TRAINER = BENCH_DIR / "noop_trainer.py"
SIZES = (64, 256, 1024)
PARSE_ROUNDS = (1, 3)
# docs/scale.md: on 2 cores 16 slots ran 256 site tasks ~20 % faster than 8 (2.44-2.46 vs 2.04 tasks/s),
# 4 slots half as fast; 16 slots with 32 tasks of the DAG allowed in flight was no faster.
PARALLELISM = 16
CHILD_TIMEOUT = 300  # one parse measurement in a fresh interpreter
DAG_VISIBLE_TIMEOUT = 300  # from writing the DAG file until the API serves the DAG
# Wall-time budget from trigger to the end of a run, per size (the goal for 1024 sites is
# 400 s on a quiet machine); a run still going when its budget is spent is stopped and reported as
# far as it got.
RUN_BUDGET = {64: 300.0, 256: 420.0, 1024: 600.0}
QUICK_RUN_BUDGET = {64: 300.0}
PLAIN_SIZES = (256,)  # sizes also run on a stack without the preload (full set only)

# Airflow settings that bound this benchmark: (section, key, what it does here).
LIMITS = (
    ("core", "parallelism", "task instances running at once in the whole scheduler (executor slots)"),
    ("core", "max_active_tasks_per_dag", "running + queued task instances of one DAG (all its runs)"),
    ("scheduler", "max_tis_per_query", "task instances the scheduler examines/queues per query in a loop"),
    ("scheduler", "task_queued_timeout", "a task queued longer than this is failed/rescheduled"),
    ("core", "dagbag_import_timeout", "per DAG-file import limit, in the dag-processor *and* in each task process"),
    ("dag_processor", "dag_file_processor_timeout", "the dag-processor kills a file's parser after this"),
    ("dag_processor", "min_file_process_interval", "each DAG file is re-parsed this often"),
    ("dag_processor", "refresh_interval", "how often the dags folder is listed for new files"),
    ("dag_processor", "parsing_processes", "DAG files parsed at once"),
    ("api", "maximum_page_limit", "REST page size cap (a 1024-site run has 1027 task instances)"),
)


# --- part 1: DAG parse in a fresh interpreter ----------------------------------------------------------

PARSE_CHILD = textwrap.dedent(
    """
    import json, sys, time
    job, dag_file, dag_id = sys.argv[1], sys.argv[2], sys.argv[3]
    t0 = time.perf_counter()
    import flare_airflow.builder as builder
    t1 = time.perf_counter()
    dag = builder.build_dag(job, dag_id=dag_id)
    t2 = time.perf_counter()
    from airflow.serialization.serialized_objects import DagSerialization
    t3 = time.perf_counter()
    serialized = DagSerialization.to_dict(dag)
    blob = json.dumps(serialized)
    t4 = time.perf_counter()
    tasks = serialized["dag"]["tasks"]
    site = next(t["__var"] for t in tasks if t["__var"]["task_id"].startswith("round_1.site-"))
    from pathlib import Path
    from airflow.dag_processing.dagbag import BundleDagBag
    t5 = time.perf_counter()
    # As the Task SDK parses the DAG file at each task's start-up (task_runner.parse).
    bag = BundleDagBag(
        dag_folder=dag_file, safe_mode=False, load_op_links=False,
        bundle_path=Path(dag_file).parent, bundle_name="dags-folder",
    )
    t6 = time.perf_counter()
    # What one site task's process parses: Airflow's parsing context names the DAG and the task.
    import os
    os.environ["_AIRFLOW_PARSING_CONTEXT_DAG_ID"] = dag_id
    os.environ["_AIRFLOW_PARSING_CONTEXT_TASK_ID"] = site["task_id"]
    site_bag = BundleDagBag(
        dag_folder=dag_file, safe_mode=False, load_op_links=False,
        bundle_path=Path(dag_file).parent, bundle_name="dags-folder",
    )
    t7 = time.perf_counter()
    out = {
        "import": t1 - t0, "build": t2 - t1, "serialize": t4 - t3, "dagbag": t6 - t5, "site_dagbag": t7 - t6,
        "site_dagbag_tasks": len(site_bag.dags[dag_id].tasks),
        "tasks": len(dag.tasks), "size": len(blob), "site_task_bytes": len(json.dumps(site)),
        "tasks_with_params": sum(1 for t in tasks if t["__var"].get("params")),
        "dag_params_bytes": len(json.dumps(serialized["dag"].get("params", []))),
        "dagbag_dags": sorted(bag.dag_ids),
        "import_errors": {str(k): str(v)[-500:] for k, v in bag.import_errors.items()},
    }
    print("RESULT " + json.dumps(out))
    """
)


def write_init_model(path: Path) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"weight": np.zeros((16, 16), np.float32), "bias": np.zeros(16, np.float32)}, str(path))
    return path


def site_names(n: int) -> list[str]:
    return [f"site-{i:04d}" for i in range(1, n + 1)]


def dag_id_of(n: int, rounds: int) -> str:
    return f"scale_{n}_r{rounds}"


def write_job(folder: Path, n: int, rounds: int, init: Path) -> tuple[Path, Path]:
    """A job YAML (written as JSON, which is YAML) and its one-line DAG file, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    dag_id = dag_id_of(n, rounds)
    job = {
        "job": dag_id.replace("_", "-"),
        "rounds": rounds,
        "min_clients": n,  # every site must count: a run that succeeds used all N updates
        "initial_model": str(init),
        "trainer": {"script": str(TRAINER)},
        "evaluate": False,
        "sites": {s: {} for s in site_names(n)},
    }
    job_file = folder / f"{dag_id}.yaml"
    job_file.write_text(json.dumps(job, indent=1) + "\n")
    dag_file = folder / f"{dag_id}_dag.py"
    dag_file.write_text(
        textwrap.dedent(
            f'''\
            """Scale benchmark DAG: {n} process sites x {rounds} round(s), no-op trainer."""
            from pathlib import Path

            from flare_airflow.builder import build_dag

            dag = build_dag(Path(__file__).with_name("{job_file.name}"), dag_id="{dag_id}")
            '''
        )
    )
    return job_file, dag_file


def clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "PYTHONWARNINGS": "ignore::DeprecationWarning",
        }
    )
    return env


@dataclass
class ParseResult:
    n: int
    rounds: int
    wall: list[float] = field(default_factory=list)  # the whole fresh interpreter
    phases: dict[str, list[float]] = field(default_factory=dict)
    tasks: int = 0
    size: int = 0
    site_task_bytes: int = 0
    tasks_with_params: int = 0
    dag_params_bytes: int = 0
    site_dagbag_tasks: int = 0


def parse_part(root: Path, sizes: tuple[int, ...], rounds_list: tuple[int, ...], reps: int) -> list[ParseResult]:
    init = write_init_model(root / "init.safetensors")
    home = root / "parse-home"
    home.mkdir(parents=True, exist_ok=True)
    env = clean_env(home)
    cases = [(n, r) for n in sizes for r in rounds_list]
    files = {c: write_job(root / f"parse-{c[0]}-{c[1]}", c[0], c[1], init) for c in cases}
    results = {c: ParseResult(*c) for c in cases}
    for rep in range(reps):
        # Alternate the order each repetition (forward, backward) so no size always runs first.
        for n, r in cases if rep % 2 == 0 else cases[::-1]:
            job_file, dag_file = files[(n, r)]
            argv = [sys.executable, "-c", PARSE_CHILD, str(job_file), str(dag_file), dag_id_of(n, r)]
            started = time.monotonic()
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT, check=False)
            wall = time.monotonic() - started
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                raise BenchmarkFailed(
                    f"parse of {n} sites x {r} rounds exited {proc.returncode}: {proc.stderr[-3000:]}"
                )
            out = json.loads(line[len("RESULT ") :])
            if out["import_errors"] or out["dagbag_dags"] != [dag_id_of(n, r)]:
                raise BenchmarkFailed(f"DagBag of {dag_file}: dags {out['dagbag_dags']}, errors {out['import_errors']}")
            res = results[(n, r)]
            res.wall.append(wall)
            res.site_dagbag_tasks = out["site_dagbag_tasks"]
            for key in ("import", "build", "serialize", "dagbag", "site_dagbag"):
                res.phases.setdefault(key, []).append(out[key])
            res.tasks, res.size, res.site_task_bytes = out["tasks"], out["size"], out["site_task_bytes"]
            res.tasks_with_params, res.dag_params_bytes = out["tasks_with_params"], out["dag_params_bytes"]
            log(
                f"[scale] parse rep {rep + 1}/{reps} {n} sites x {r}: build {out['build']:.2f}s, "
                f"serialize {out['serialize']:.2f}s ({out['size'] / 1e6:.1f} MB), DagBag {out['dagbag']:.2f}s, "
                f"interpreter {wall:.1f}s"
            )
    return [results[c] for c in cases]


def parse_tables(results: list[ParseResult], reps: int, limits: dict[str, str]) -> list[Table]:
    main = Table(
        "DAG parse in a fresh interpreter (median of the repetitions; min-max in brackets)",
        [
            "sites x rounds",
            "tasks",
            "`import flare_airflow.builder` s",
            "`build_dag` s",
            "serialize s",
            "serialized JSON MB",
            "`DagBag(file)` s",
            "a site task's `DagBag(file)` s",
            "whole interpreter s",
        ],
    )
    for res in results:

        def cell(key: str, res: ParseResult = res) -> str:
            values = res.phases[key]
            return f"{median(values):.2f} ({spread(values)})"

        main.add(
            f"{res.n} x {res.rounds}",
            res.tasks,
            cell("import"),
            cell("build"),
            cell("serialize"),
            f"{res.size / 1e6:.2f}",
            cell("dagbag"),
            cell("site_dagbag") + f", {res.site_dagbag_tasks} tasks",
            f"{median(res.wall):.2f} ({spread(res.wall)})",
        )
    main.notes += [
        f"{reps} repetitions, each case in a fresh `python` process, order alternating. In each process: import "
        "(Airflow SDK + our operators), `build_dag(job.yaml)`, `DagSerialization.to_dict` + `json.dumps` (what "
        "the dag-processor writes to the metadata DB), then `BundleDagBag(<dag file>)` -- Airflow's own loader "
        "(`airflow dags list-import-errors --local` runs the same) with our modules already imported, so it is "
        "Airflow's file import + `build_dag`. No import errors in any DagBag.",
        "`DagBag(file)` is what the dag-processor pays per parse. Each task's process re-parses the DAG file too "
        "(`Worker startup parse complete ... dag_file_parse_ms` in the task log; see the scheduler table), and a "
        "site task's process builds only its own site's tasks and the run's own: 'a site task's `DagBag(file)`' is "
        "that parse with Airflow's parsing context naming a site task (`_AIRFLOW_PARSING_CONTEXT_DAG_ID`/`_TASK_ID`, "
        "as the Task SDK sets them) and our modules already imported -- what a task pays when its worker preloaded "
        "them (docs/scale.md); without that, the task pays the import column as well. "
        f"`core.dagbag_import_timeout` here: {limits.get('core.dagbag_import_timeout', '?')} s; "
        f"`dag_processor.dag_file_processor_timeout`: {limits.get('dag_processor.dag_file_processor_timeout', '?')} s.",
    ]
    size = Table(
        "Serialized DAG: what each task costs (1 round)",
        [
            "sites",
            "serialized JSON MB",
            "bytes per site task",
            "serialize ms per task (median)",
            "tasks carrying a copy of the form (`params`)",
            "the form on the DAG, bytes",
        ],
    )
    for res in results:
        if res.rounds != 1:
            continue
        size.add(
            res.n,
            f"{res.size / 1e6:.2f}",
            res.site_task_bytes,
            f"{median(res.phases['serialize']) / res.tasks * 1000:.2f}",
            res.tasks_with_params,
            res.dag_params_bytes,
        )
    size.notes.append(
        "Airflow gives every task created inside a DAG that has `params` its own deep copy of them, and "
        "`DagSerialization` writes and JSON-schema-checks that copy task by task. `build_dag` puts the trigger "
        "form on the DAG after its tasks exist, so the form is stored (and checked) once; tasks get it at run "
        "time from the DAG (the Task SDK merges DAG and task params). Before that (git 2df1acd, 1024 sites x 1 "
        "round, same machine): 1599 bytes per site task, of which 949 the form's copy; to_dict 1.41 s = 1.37 ms "
        "per task, 95 % of it the per-task Param schema checks; 1.79 MB in all."
    )
    return [main, size]


# --- part 2: the real scheduler ------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[int, int, float, float] | None:
    """(ppid, session, own CPU s, reaped children's CPU s) of a process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()
    tick = os.sysconf("SC_CLK_TCK")
    own = (int(rest[11]) + int(rest[12])) / tick
    kids = (int(rest[13]) + int(rest[14])) / tick
    return int(rest[1]), int(rest[3]), own, kids


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


@dataclass
class CpuSample:
    wall: float
    machine_busy: float
    sessions: dict[str, float]  # component -> CPU s ever used by its session (live + reaped)
    scheduler_self: float  # the scheduler's own process: its scheduling loop


def _machine_busy() -> float:
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]
    steal = fields[7] if len(fields) > 7 else 0
    return (sum(fields[:8]) - idle - steal) / tick


def cpu_sample(components: dict[str, int]) -> CpuSample:
    by_sid = {sid: name for name, sid in components.items()}
    sessions = dict.fromkeys(components, 0.0)
    sched_self = 0.0
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st is None or st[1] not in by_sid:
            continue
        sessions[by_sid[st[1]]] += st[2] + st[3]
        if pid == components.get("scheduler"):
            sched_self = st[2]
    return CpuSample(time.monotonic(), _machine_busy(), sessions, sched_self)


def descendants(roots: list[int]) -> list[int]:
    """Every live process below ``roots`` (task processes leave the components' sessions via setsid)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
    found: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found.append(child)
            todo.append(child)
    return found


def stop_stack(stack: Any, pg: Any) -> None:
    """Stop an Airflow stack (when started) and its PostgreSQL, and kill the task processes that left
    the components' sessions (BashOperator's setsid) and would outlive them."""
    if stack is not None:
        tree = descendants([p.pid for p in stack.procs])
        stack.stop()
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    if pg is not None:
        pg.stop()


def _ts(value: str | None) -> float | None:
    return datetime.datetime.fromisoformat(value).timestamp() if value else None


@dataclass
class StackRun:
    n: int
    dag_id: str
    budget: float
    preload: bool = True  # the stack's Airflow local settings import the provider (docs/scale.md)
    visible_s: float = 0.0  # file written -> DAG served by the API
    processor_parse_s: float | None = None  # the dag-processor's own last_parse_duration
    outcome: str = ""
    finished: bool = False
    trigger_wall: float = 0.0  # time.time() just before POST dagRuns
    run_s: float | None = None  # trigger -> run success (our clock, polled every 1 s)
    elapsed_s: float = 0.0  # trigger -> end of our wait (success or budget)
    tis: list[dict[str, Any]] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    sched_self: float = 0.0
    machine_busy: float = 0.0
    worker_parse_ms: list[float] = field(default_factory=list)
    log_summary: dict[str, Counter[str]] = field(default_factory=dict)
    log_flags: dict[str, list[str]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.n}" if self.preload else f"{self.n} (not preloaded)"

    def sites(self) -> list[dict[str, Any]]:
        return [t for t in self.tis if ".site-" in t["task_id"]]


def fetch_tis(stack: Any, dag_id: str, run_id: str) -> list[dict[str, Any]]:
    """All task instances of a run (the API caps a page at ``api.maximum_page_limit``, 100 by default)."""
    tis: list[dict[str, Any]] = []
    while True:
        body = stack.api(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100, "offset": len(tis)}
        )
        page = body["task_instances"]
        tis.extend(page)
        if not page or len(tis) >= body["total_entries"]:
            return tis


_LEVEL = re.compile(r"\[(debug|info|warning|error|critical)\s*\]")
_NOISE = re.compile(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?")
FLAG_PATTERNS = {
    "timeout": re.compile(r"timeout|timed out", re.I),
    "max_active_tasks limit": re.compile(r"max_active_tasks limit"),
    "no open pool slots": re.compile(r"open slots in (the )?pool"),
    "no executor slots": re.compile(r"no (available|open) slots|executor .*(full|capacity)", re.I),
    "Traceback": re.compile(r"Traceback"),
    "zombie / heartbeat": re.compile(r"zombie|heartbeat.*(missed|timed)|no heartbeat", re.I),
}


def summarise_log(text: str) -> tuple[Counter[str], dict[str, list[str]]]:
    """Warnings/errors by message shape (numbers and ids blanked), and the lines matching FLAG_PATTERNS."""
    counts: Counter[str] = Counter()
    flags: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _LEVEL.search(line)
        level = m.group(1) if m else None
        for name, pattern in FLAG_PATTERNS.items():
            if pattern.search(line):
                flags.setdefault(name, []).append(line.strip()[:300])
        if level in ("warning", "error", "critical"):
            message = line[m.end() :].strip() if m else line
            counts[f"{level}: {_NOISE.sub('#', message)[:140]}"] += 1
        elif level is None and "Traceback" in line:
            counts["(traceback, no level)"] += 1
    return counts, flags


class LogSlicer:
    """Remembers each component log's size so a run's own slice can be read afterwards."""

    def __init__(self, root: Path, components: tuple[str, ...]) -> None:
        self.paths = {c: root / f"{c}.log" for c in components}
        self.marks = dict.fromkeys(components, 0)

    def mark(self) -> None:
        for c, p in self.paths.items():
            self.marks[c] = p.stat().st_size if p.exists() else 0

    def since_mark(self) -> dict[str, str]:
        out = {}
        for c, p in self.paths.items():
            with p.open("rb") as fh:
                fh.seek(self.marks[c])
                out[c] = fh.read().decode(errors="replace")
        return out


def worker_parse_ms(home: Path, dag_id: str) -> list[float]:
    """``dag_file_parse_ms`` of each site task's start-up, from the task logs (JSON lines)."""
    values = []
    for path in (home / "logs").glob(f"dag_id={dag_id}/*/task_id=round_1.site-*/attempt=*.log"):
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if "Worker startup parse complete" in line:
                    with contextlib.suppress(ValueError, KeyError):
                        values.append(float(json.loads(line)["dag_file_parse_ms"]))
                    break
    return values


def our_task_cpu(root: Path, reps: int) -> tuple[float, float]:
    """CPU s and wall s of one site job's own processes outside Airflow: bash -> site_runner -> trainer."""
    from flare_airflow.site_task.spec import SPEC_ENV

    work = root / "site-job"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
    cpu, wall = [], []
    for rep in range(reps):
        spec = bench_e2e.noop_site_run(work, "site-0001", work / f"update-{rep}.safetensors")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        proc = subprocess.run(
            ["bash", "-c", f"exec {sys.executable} -m flare_airflow.site_task"],
            env={**env, SPEC_ENV: spec.to_json()},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        wall.append(time.monotonic() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise BenchmarkFailed(f"site job outside Airflow exited {proc.returncode}: {proc.stderr[-2000:]}")
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return median(cpu), median(wall)


def airflow_limits(env: dict[str, str]) -> dict[str, str]:
    """The effective values of LIMITS in the stack's environment (one `airflow config get-value` process)."""
    code = textwrap.dedent(
        """
        import json, sys
        from airflow.configuration import conf
        out = {}
        for item in sys.argv[1:]:
            section, key = item.split(".")
            try:
                out[item] = conf.get(section, key)
            except Exception as exc:
                out[item] = f"? ({exc.__class__.__name__})"
        print("RESULT " + json.dumps(out))
        """
    )
    argv = [sys.executable, "-c", code, *(f"{s}.{k}" for s, k, _ in LIMITS)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise BenchmarkFailed(f"reading Airflow's configuration failed: {proc.stderr[-2000:]}")
    return dict(json.loads(line[len("RESULT ") :]))


def run_one(stack: Any, slicer: LogSlicer, components: dict[str, int], n: int, budget: float, init: Path) -> StackRun:
    dag_id = dag_id_of(n, 1)
    res = StackRun(n=n, dag_id=dag_id, budget=budget)
    written = time.monotonic()
    _, dag_file = write_job(stack.dags, n, 1, init)
    stack.wait_for_dag(dag_id, timeout=DAG_VISIBLE_TIMEOUT)
    res.visible_s = time.monotonic() - written
    details = stack.api("GET", f"/dags/{dag_id}/details")
    res.processor_parse_s = details.get("last_parse_duration")
    log(f"[scale] {dag_id}: served by the API {res.visible_s:.1f}s after the file was written")
    stack.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
    time.sleep(2)  # let the unpause settle; the CPU window starts at the trigger
    slicer.mark()
    before = cpu_sample(components)
    res.trigger_wall = time.time()
    started = time.monotonic()
    run_id = str(stack.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": {}})["dag_run_id"])
    state = "queued"
    last_progress = started
    while time.monotonic() - started < budget:
        state = str(stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"])
        if state in ("success", "failed"):
            break
        if time.monotonic() - last_progress > 30:
            last_progress = time.monotonic()
            done = sum(1 for t in fetch_tis(stack, dag_id, run_id) if t["state"] == "success")
            log(f"[scale] {dag_id}: {time.monotonic() - started:.0f}s, {done} task instances succeeded")
        time.sleep(1)
    res.elapsed_s = time.monotonic() - started
    after = cpu_sample(components)
    res.cpu = {c: after.sessions[c] - before.sessions[c] for c in components}
    res.sched_self = after.scheduler_self - before.scheduler_self
    res.machine_busy = after.machine_busy - before.machine_busy
    res.tis = fetch_tis(stack, dag_id, run_id)
    res.finished = state == "success"
    # The logs from the trigger to the end of the wait (before a stopped run's tasks are killed below).
    for component, text in slicer.since_mark().items():
        res.log_summary[component], res.log_flags[component] = summarise_log(text)
    if state == "success":
        res.run_s = res.elapsed_s
        res.outcome = "success"
    elif state == "failed":
        bad = {t["task_id"]: t["state"] for t in res.tis if t["state"] != "success"}
        raise BenchmarkFailed(f"run {run_id} of {dag_id} failed; tasks not successful: {dict(list(bad.items())[:20])}")
    else:
        states = Counter(str(t["state"]) for t in res.sites())
        res.outcome = f"stopped after {budget:.0f} s: site tasks " + ", ".join(
            f"{k} {v}" for k, v in states.most_common()
        )
        log(f"[scale] {dag_id}: budget spent, marking the run failed ({res.outcome})")
        with contextlib.suppress(RuntimeError):
            stack.api("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})
        time.sleep(5)  # the scheduler sends SIGTERM to the running tasks
    res.worker_parse_ms = worker_parse_ms(stack.home, dag_id)
    # This DAG stops being re-parsed (and costing CPU) once its file is gone.
    dag_file.unlink()
    stack.api("PATCH", f"/dags/{dag_id}", json={"is_paused": True})
    return res


def write_preload(home: Path) -> Path:
    """``$AIRFLOW_HOME/config/airflow_local_settings.py`` importing the provider, as docs/scale.md recommends."""
    block = re.search(
        r"```python\n(# \$AIRFLOW_HOME/config/airflow_local_settings\.py\n.*?)```",
        (REPO / "docs" / "scale.md").read_text(),
        re.S,
    )
    if block is None:
        raise BenchmarkFailed("docs/scale.md has no airflow_local_settings.py block to benchmark")
    path = home / "config" / "airflow_local_settings.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block.group(1))
    return path


def stack_part(
    root: Path,
    sizes: tuple[int, ...],
    budgets: dict[int, float],
    extra_env: dict[str, str] | None = None,
    *,
    preload: bool = True,
) -> tuple[list[StackRun], dict[str, Any]]:
    sys.path.insert(0, str(REPO))
    from flare_airflow_testing.stack import AirflowStack, Postgres

    init = write_init_model(root / "init.safetensors")
    info: dict[str, Any] = {}
    pg = None
    stack = None
    runs: list[StackRun] = []
    try:
        started = time.monotonic()
        pg = Postgres()
        stack = AirflowStack(root / "stack", pg.url, parallelism=PARALLELISM, extra_env=extra_env)
        info["migrate_s"] = time.monotonic() - started
        if preload:
            write_preload(stack.home)
        info["preload"] = preload
        info["limits"] = airflow_limits(stack.env)
        started = time.monotonic()
        stack.start()
        info["start_s"] = time.monotonic() - started
        components = dict(zip(("api-server", "scheduler", "dag-processor"), (p.pid for p in stack.procs), strict=True))
        postmaster = _proc_stat(int((pg.data / "postmaster.pid").read_text().split()[0]))
        if postmaster is not None:
            components["postgres"] = postmaster[1]  # pg_ctl starts the postmaster in a session of its own
        log(f"[scale] PostgreSQL + Airflow up (migrate {info['migrate_s']:.0f}s, start {info['start_s']:.0f}s)")
        time.sleep(5)
        idle0 = cpu_sample(components)
        time.sleep(10)
        idle1 = cpu_sample(components)
        info["idle_cores"] = {
            c: (idle1.sessions[c] - idle0.sessions[c]) / (idle1.wall - idle0.wall) for c in components
        }
        slicer = LogSlicer(stack.root, ("api-server", "scheduler", "dag-processor"))
        for n in sizes:
            log(f"[scale] one round of {n} sites (budget {budgets[n]:.0f}s) ...")
            runs.append(run_one(stack, slicer, components, n, budgets[n], init))
            r = runs[-1]
            r.preload = preload
            log(f"[scale] {r.dag_id}: {r.outcome} in {r.elapsed_s:.0f}s")
        info["import_errors"] = stack.api("GET", "/importErrors")["total_entries"]
    finally:
        stop_stack(stack, pg)
    return runs, info


def stack_tables(runs: list[StackRun], info: dict[str, Any], ours_cpu: float, ours_wall: float) -> list[Table]:
    limits = info["limits"]
    sched = Table(
        f"One round under the real scheduler (PostgreSQL, LocalExecutor, `core.parallelism` = {PARALLELISM})",
        [
            "sites",
            "provider preloaded",
            "outcome",
            "file -> DAG in API s",
            "dag-processor parse s",
            "trigger -> run success s",
            "trigger -> first site queued s",
            "trigger -> last site queued s",
            "first site start -> last site end s",
            "site tasks / s",
            "peak concurrent site tasks",
            "site task duration s (median)",
            "per-task DAG re-parse s (median)",
        ],
    )
    for r in runs:
        sites = r.sites()
        queued = sorted(q for t in sites if (q := _ts(t.get("queued_when"))) is not None)
        starts = [s for t in sites if (s := _ts(t.get("start_date"))) is not None]
        done = [t for t in sites if t["state"] == "success"]
        ends = [e for t in done if (e := _ts(t.get("end_date"))) is not None]
        durations = [float(t["duration"]) for t in done if t.get("duration") is not None]
        intervals = [
            (s, e) for t in sites if (s := _ts(t.get("start_date"))) and (e := _ts(t.get("end_date")) or time.time())
        ]
        span = (max(ends) - min(starts)) if ends and starts else None
        rate = site_rate(r)
        first_q = f"{queued[0] - r.trigger_wall:.1f}" if queued else "-"
        last_q = (
            f"{queued[-1] - r.trigger_wall:.1f}" if queued and len(queued) == r.n else f"- ({len(queued)}/{r.n} queued)"
        )
        sched.add(
            r.n,
            "yes" if r.preload else "**no**",
            r.outcome
            if r.finished
            else f"**{r.outcome}**" + (f"; all {r.n} at this rate: ~{r.n / rate:.0f} s" if rate else ""),
            f"{r.visible_s:.1f}",
            f"{r.processor_parse_s:.2f}" if r.processor_parse_s is not None else "-",
            f"{r.run_s:.1f}" if r.run_s is not None else f"- (> {r.budget:.0f})",
            first_q,
            last_q,
            f"{span:.1f}" if span else "-",
            f"{rate:.2f}" if rate else "-",
            max_overlap(intervals),
            f"{median(durations):.2f}" if durations else "-",
            f"{median(r.worker_parse_ms) / 1000:.2f} (n={len(r.worker_parse_ms)})" if r.worker_parse_ms else "-",
        )
    sched.notes += [
        "Times from the API's task instances (`queued_when`, `start_date`, `end_date`) against our clock at the "
        "trigger (same machine); 'trigger -> run success' is polled every 1 s. A run that succeeded used all N "
        "updates (`min_clients` = N). 'per-task DAG re-parse' is the Task SDK's own `dag_file_parse_ms` from each "
        "site task's log: every task process re-imports the DAG file before it runs; for a site task the builder "
        "then makes only that site's tasks and the run's own (prepare, aggregations, publish; "
        "`flare_airflow.builder.running_site`), so the tasks it builds do not grow with N; reading and validating "
        "the N-site job file does (~0.05 CPU s at 1024 sites), and the wall time here includes waiting for the CPU "
        f"({PARALLELISM} tasks at once on 2 cores).",
        "'provider preloaded': the stack's `$AIRFLOW_HOME/config/airflow_local_settings.py` imports "
        "`flare_airflow.builder` (docs/scale.md), so the LocalExecutor's workers -- forked from the scheduler -- "
        "fork each task process with our modules already imported and the re-parse skips their import. The "
        "'not preloaded' row ran first, on a stack of its own with everything else equal.",
        f"One DAG file at a time in the dags folder (removed after its run). Stack: `airflow db migrate` + private "
        f"PostgreSQL {info['migrate_s']:.0f} s, components up in {info['start_s']:.0f} s. Import errors at the end: "
        f"{info.get('import_errors', '?')}.",
    ]

    cpu = Table(
        "CPU seconds per site task (CPU of each component's sessions during the run / site tasks that succeeded)",
        [
            "sites",
            "provider preloaded",
            "site tasks counted",
            "scheduler loop",
            "executor workers + task processes",
            "of which outside our processes",
            "api-server (execution API)",
            "dag-processor",
            "PostgreSQL",
            "**total stack**",
            "machine busy cores (avg)",
            "other processes on the machine (cores)",
            "**CPU-bound max site tasks / s** (2 cores / total)",
            "observed site tasks / s",
        ],
    )
    for r in runs:
        counted = sum(1 for t in r.sites() if t["state"] == "success") or 1
        workers = r.cpu["scheduler"] - r.sched_self
        total = sum(r.cpu.values())
        rate = site_rate(r)
        cpu.add(
            r.n,
            "yes" if r.preload else "**no**",
            counted,
            f"{r.sched_self / counted:.2f}",
            f"{workers / counted:.2f}",
            f"{workers / counted - ours_cpu:.2f}",
            f"{r.cpu['api-server'] / counted:.2f}",
            f"{r.cpu['dag-processor'] / counted:.2f}",
            f"{r.cpu.get('postgres', 0.0) / counted:.2f}",
            f"**{total / counted:.2f}**",
            f"{r.machine_busy / r.elapsed_s:.2f}",
            f"{max(0.0, r.machine_busy - total) / r.elapsed_s:.2f}",
            f"**{2 / (total / counted):.2f}**",
            f"{rate:.2f}" if rate else "-",
        )
    idle = info["idle_cores"]
    cpu.notes += [
        f"Our own processes of one site task, timed outside Airflow (bash -> `python -m "
        f"flare_airflow.site_task` -> no-op trainer): **{ours_cpu:.2f} CPU s** ({ours_wall:.2f} s wall), "
        "median of the repetitions. 'of which outside our processes' = 'executor workers + task processes' minus "
        "that: the task's Airflow side -- the LocalExecutor worker acting as supervisor, the forked task process's "
        "Task SDK start-up, the DAG re-parse (see the previous table) and the execution-API calls (whose server side "
        "is the api-server column).",
        "The run's prepare, global_model (FedAvg over N updates) and publish tasks are included in the totals but "
        "not in the task count; for a stopped run the tasks still running at the budget are not counted either. "
        "Idle stack before the first run (cores): "
        + ", ".join(f"{c} {v:.3f}" for c, v in idle.items())
        + ". 'machine busy' is the whole machine (/proc/stat); 'other processes' is what the stack's sessions do "
        "not explain: other work on the machine (concurrent jobs of other users), this benchmark's own polling, the "
        "kernel. It takes CPU away from the stack, so the observed rate can only approach 2 cores minus that.",
        "'CPU-bound max' = 2 cores / total CPU per site task: the rate this machine could sustain if CPU were the "
        "only limit. When the observed rate is close to it, the run is CPU-bound, not limited by Airflow's slots.",
    ]

    logs = Table(
        "What the scheduler, dag-processor and api-server logged during each run",
        ["sites", "component", "warnings / errors (by message, count)", "lines matching"],
    )
    for r in runs:
        for component in ("scheduler", "dag-processor", "api-server"):
            counts = r.log_summary.get(component, Counter())
            top = "; ".join(f"`{m}` x{c}" for m, c in counts.most_common(4)) or "none"
            flags = r.log_flags.get(component, {})
            flag_cell = ", ".join(f"{k}: {len(v)}" for k, v in flags.items()) or "none"
            logs.add(r.label, component, top.replace("|", "\\|"), flag_cell)
    examples = []
    for r in runs:
        for component, flags in r.log_flags.items():
            for name, lines in flags.items():
                examples.append(f"- {r.label} sites, {component}, {name} (first of {len(lines)}): `{lines[0][:240]}`")
    if examples:
        logs.notes += ["Example lines:", *(e.replace("|", "\\|") for e in examples[:12])]

    config = Table("Airflow limits that matter at this scale", ["setting", "value here", "what it bounds"])
    for section, key, what in LIMITS:
        config.add(f"`{section}.{key}`", limits.get(f"{section}.{key}", "?"), what)
    config.notes.append(
        f"Set by the benchmark (flare_airflow_testing/stack.py): `core.parallelism` = {PARALLELISM}, "
        "`scheduler.scheduler_heartbeat_sec` = 1, `dag_processor.refresh_interval` = 5, LocalExecutor, PostgreSQL "
        "(fsync off); the 'provider preloaded' stacks also have docs/scale.md's `airflow_local_settings.py`. "
        "Everything else is Airflow's default. The binding Airflow limit on concurrency is the smaller of "
        f"`core.parallelism` ({PARALLELISM}) and `core.max_active_tasks_per_dag` "
        f"({limits.get('core.max_active_tasks_per_dag', '?')}); docs/scale.md has the measurements of other values."
    )
    return [sched, cpu, logs, config]


def site_rate(r: StackRun) -> float | None:
    """Site tasks that succeeded per second, from the first site task's start to the last one's end."""
    done = [t for t in r.sites() if t["state"] == "success"]
    starts = [s for t in r.sites() if (s := _ts(t.get("start_date"))) is not None]
    ends = [e for t in done if (e := _ts(t.get("end_date"))) is not None]
    span = (max(ends) - min(starts)) if ends and starts else 0.0
    return len(done) / span if span > 0 else None


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


# --- the benchmark -------------------------------------------------------------------------------------


def run(*, reps: int, quick: bool, keep: bool, tmp_base: str | None) -> list[Table]:
    """Both parts; while iterating, ``FLARE_SCALE_PARTS=parse`` (or ``stack``) runs one of them,
    ``FLARE_SCALE_SIZES=256`` picks the sizes of the scheduler part (preloaded stack only) and
    ``FLARE_SCALE_PARALLELISM`` its ``core.parallelism``."""
    global PARALLELISM
    parts = set(os.environ.get("FLARE_SCALE_PARTS", "parse,stack").split(","))
    PARALLELISM = int(os.environ.get("FLARE_SCALE_PARALLELISM", PARALLELISM))
    root = Path(tempfile.mkdtemp(prefix="flare-bench-scale-", dir=tmp_base))
    root.chmod(0o755)
    ok = False
    tables: list[Table] = []
    try:
        if "parse" in parts:
            parse_sizes = SIZES[:2] if quick else SIZES
            parse_rounds = PARSE_ROUNDS[:1] if quick else PARSE_ROUNDS
            log(f"[scale] parse: {parse_sizes} sites x {parse_rounds} rounds, {reps} repetitions ({root})")
            parse_results = parse_part(root / "parse", parse_sizes, parse_rounds, reps)
            tables += parse_tables(parse_results, reps, airflow_limits(clean_env(root / "parse" / "parse-home")))
        if "stack" in parts:
            ours_cpu, ours_wall = our_task_cpu(root, reps)
            log(f"[scale] one site job's own processes outside Airflow: {ours_cpu:.2f} CPU s, {ours_wall:.2f} s wall")
            budgets = QUICK_RUN_BUDGET if quick else RUN_BUDGET
            sizes = tuple(int(n) for n in os.environ.get("FLARE_SCALE_SIZES", "").split(",") if n) or tuple(budgets)
            plain_runs: list[StackRun] = []
            if not quick and "FLARE_SCALE_SIZES" not in os.environ:
                # The same round without the preload, on a stack of its own (the scheduler imports its
                # local settings once, at start), as the comparison for docs/scale.md's recommendation.
                plain_runs, _ = stack_part(root / "stack-plain", PLAIN_SIZES, budgets, preload=False)
            runs, info = stack_part(
                root / "stack-root", sizes, {n: budgets.get(n, max(budgets.values())) for n in sizes}, preload=True
            )
            tables += stack_tables(plain_runs + runs, info, ours_cpu, ours_wall)
        ok = True
    finally:
        if keep or not ok:
            log(f"[scale] kept {root} (component logs under {root / 'stack-root' / 'stack'})")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return tables
