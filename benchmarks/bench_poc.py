"""Under the real scheduler: flare-airflow's real deployment side by side with NVIDIA FLARE's POC mode.

* **ours** -- ``flare_airflow_testing.stack``: a private PostgreSQL, api-server, scheduler (LocalExecutor) and
  dag-processor, started once (untimed) with the jobs' DAG files already in the dags folder; the
  benchmark waits until every DAG is serialised and unpaused, then triggers each run through the
  REST API (``POST /api/v2/dags/{id}/dagRuns``, what the UI's trigger button sends) and polls the
  run until it is terminal. Two deployments run side by side: one with Airflow's defaults for every
  setting this benchmark tunes, one with :data:`TUNED` (what docs/deploy-compose.md recommends).
* **NVFlare** -- ``nvflare poc prepare`` (a project file with free ports) + ``nvflare poc start``:
  the server and one client per site as separate processes, started once per number of sites
  (untimed); jobs exported by NVFlare's ``NumpyFedAvgRecipe`` (``nvflare_jobs/job.py --export-dir``)
  and submitted through NVFlare's admin API (``nvflare_jobs/poc_submit.py``: ``Session.submit_job``,
  status polled with ``get_job_meta``); ``nvflare poc stop`` at the end, then a check that no
  process of the POC system is left (any left is killed by id and reported).

Jobs: those of :mod:`bench_nvflare`'s end-to-end part (hello-numpy-style 2 sites x 1, 3 and 10
rounds; digits 4 sites x 5 rounds with ``dags/digits.yaml``'s settings). Each case runs the three
ways alternating, order rotated per repetition. Every task instance's final state is asserted,
every final model checked (hello: initial + rounds, exactly; digits: test accuracy both ways), and
NVFlare's job log must show every round aggregated from all sites.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_nvflare
from bench_common import BenchmarkFailed, Table, log, median, rotate, spread
from bench_nvflare import DIGITS, HELLO_KEY, HELLO_R1, HELLO_R3, HELLO_R10, JOBS_DIR, JobCase, NvflareEnv

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))  # flare_airflow_testing (the POC harness)
import flare_airflow_testing.nvflare_poc as testing_poc  # noqa: E402

RUN_TIMEOUT = 300.0
POLL = 0.2  # both sides poll the run's / job's state this often
TARGET = 0.5

# The settings a deployment can set that this benchmark compares: (env var, Airflow default, tuned, why).
SETTINGS: tuple[tuple[str, str, str, str], ...] = (
    (
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME",
        "1",
        "0.1",
        "the scheduler sleeps this long after a loop that queued nothing and saw no finished task: a task that "
        "ends during the sleep waits for it before its downstream tasks are queued (twice a round: sites, then "
        "FedAvg)",
    ),
    (
        "AIRFLOW__CORE__PARALLELISM",
        "32",
        "8",
        "executor slots; the LocalExecutor forks that many workers at start-up; 8 covers the widest round here "
        "(4 sites) on 2 cores (docs/scale.md)",
    ),
    (
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL",
        "30",
        "300",
        "how often each unchanged DAG file is re-parsed: every parse takes CPU from a running round on 2 cores "
        "(a changed file is still picked up when the dags folder is listed)",
    ),
)
# Both deployments: Airflow's defaults for these two (flare_airflow_testing/stack.py sets 1 s and 5 s for its tests).
COMMON = {"AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "5", "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "300"}
VARIANTS = ("ours-default", "ours-tuned")
SYSTEMS = (*VARIANTS, "nvflare")
LABEL = {
    "ours-default": "flare-airflow, Airflow defaults",
    "ours-tuned": "flare-airflow, tuned",
    "nvflare": "NVFlare POC",
}


def variant_env(variant: str) -> dict[str, str]:
    """The environment of a deployment; the defaults are set explicitly where Airflow has a value."""
    column = 1 if variant == "ours-default" else 2
    return {**COMMON, **{s[0]: s[column] for s in SETTINGS}}


def documented_local_settings() -> str:
    """docs/scale.md's ``airflow_local_settings.py`` block: the tuned deployment uses it as documented."""
    text = (REPO / "docs" / "scale.md").read_text()
    block = re.search(r"```python\n(# \$AIRFLOW_HOME/config/airflow_local_settings\.py\n.*?)```", text, re.S)
    if block is None:
        raise BenchmarkFailed("docs/scale.md lost its airflow_local_settings.py block")
    return block.group(1)


def _ts(value: str | None) -> float | None:
    return datetime.datetime.fromisoformat(value).timestamp() if value else None


@dataclass
class PocRun:
    system: str
    case: JobCase
    whole: float  # trigger/submit -> terminal state as seen through the API (polled every POLL s)
    inner: float  # ours: the run's start_date -> end_date; NVFlare: the job log's first line -> "Finished FedAvg."
    round_starts: list[float]  # wall-clock start of each round (ours: its first site task's start)
    round_ends: list[float]  # end of each round's aggregation
    final: dict[str, Any]
    accuracy: float | None = None
    tis: list[dict[str, Any]] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def per_round(self) -> float:
        """(end of the last round's aggregation - start of round 1) / rounds."""
        return (self.round_ends[-1] - self.round_starts[0]) / len(self.round_starts)

    @property
    def round_to_round(self) -> list[float]:
        return [b - a for a, b in zip(self.round_starts, self.round_starts[1:], strict=False)]

    @property
    def round_spans(self) -> list[float]:
        return [e - s for s, e in zip(self.round_starts, self.round_ends, strict=True)]


# --- NVFlare's POC system ------------------------------------------------------------------------------
# Its process helpers are the test machinery's (flare_airflow_testing/nvflare_poc.py).


class Poc(testing_poc.Poc):
    """The test machinery's POC system, with its start-up timed and its failures a benchmark's."""

    start_s = 0.0

    def _run(self, *args: str, timeout: float = 120) -> str:
        try:
            return super()._run(*args, timeout=timeout)
        except testing_poc.PocError as exc:
            raise BenchmarkFailed(str(exc)) from None

    def start(self) -> None:
        started = time.monotonic()
        try:
            super().start()
        except testing_poc.PocError as exc:
            raise BenchmarkFailed(str(exc)) from None
        self.start_s = time.monotonic() - started

    def stop(self) -> list[str]:
        leftovers = super().stop()
        if leftovers:
            log(f"[poc] `nvflare poc stop` left {len(leftovers)} processes; killed them by id: {leftovers}")
        return leftovers


def export_jobs(nv: NvflareEnv, root: Path, cases: list[JobCase], trainer: Any) -> dict[str, Path]:
    folders = {}
    for case in cases:
        argv = [*bench_nvflare.job_argv(nv, case, root / "unused", trainer), "--export-dir", str(root / "jobs")]
        proc = subprocess.run(argv, env=nv.env(), capture_output=True, text=True, timeout=180, check=False)
        result = bench_nvflare._result_line(proc.stdout)
        if proc.returncode != 0 or result is None:
            raise BenchmarkFailed(f"exporting NVFlare job {case.name} failed: {proc.stderr[-2000:]}")
        folders[case.name] = Path(result["job_folder"])
    return folders


def run_nvflare(poc: Poc, case: JobCase, job: Path, count: int, trainer: Any, split: Any) -> PocRun:

    download = poc.root / "results" / f"{count:03d}-{case.name}"
    download.mkdir(parents=True, exist_ok=True)
    argv = [
        str(poc.side.python),
        str(JOBS_DIR / "poc_submit.py"),
        "--startup-kit",
        str(poc.admin_kit),
        "--job",
        str(job),
        "--download",
        str(download),
        "--poll",
        str(POLL),
        "--timeout",
        str(RUN_TIMEOUT),
    ]
    proc = subprocess.run(argv, env=poc.env, capture_output=True, text=True, timeout=RUN_TIMEOUT + 120, check=False)
    result = bench_nvflare._result_line(proc.stdout)
    if proc.returncode != 0 or result is None:
        raise BenchmarkFailed(
            f"NVFlare POC {case.name}: poc_submit.py exited {proc.returncode}; {proc.stdout[-1500:]} "
            f"{proc.stderr[-2500:]}"
        )
    found = list(Path(result["result_dir"]).rglob("log.txt")) + list(Path(result["result_dir"]).rglob("workspace"))
    text, model = _job_log_and_model(found, case)
    starts, done, first, aggregated = bench_nvflare.server_log_rounds(text, case)
    if sorted(starts) != list(range(case.rounds)) or done is None or first is None or aggregated != case.rounds:
        raise BenchmarkFailed(
            f"NVFlare POC {case.name}: expected {case.rounds} rounds with {case.sites}/{case.sites} results each; "
            f"found round starts {sorted(starts)}, {aggregated} complete aggregations, finished={done is not None} "
            f"(job {result['job_id']}, {download})"
        )
    round_starts = [starts[k] for k in range(case.rounds)]
    if case.kind == "hello":
        final = {HELLO_KEY: model}
    else:
        features = trainer.NUM_FEATURES
        final = {"weight": model[:features], "bias": model[features]}
    run = PocRun(
        "nvflare",
        case,
        result["finished"] - result["submitted"],
        done - first,
        round_starts,
        [*round_starts[1:], done],
        final,
        marks={"submitted": result["submitted"], "accepted": result["accepted"], "first_log": first, "done": done},
    )
    _check_final(run, trainer, split)
    shutil.rmtree(download, ignore_errors=True)
    return run


def _job_log_and_model(found: list[Path], case: JobCase) -> tuple[str, Any]:
    """The server job's log.txt and models/server.npy: as files, or inside a downloaded workspace zip."""
    import io

    import numpy as np

    for path in found:
        if path.name == "log.txt" and (path.parent / "models" / "server.npy").exists():
            return path.read_text(errors="replace"), np.load(path.parent / "models" / "server.npy")
        if path.name == "workspace" and path.is_file() and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
                log_name = next((n for n in names if n.endswith("log.txt") and "/" not in n.strip("/")), None)
                model_name = next((n for n in names if n.endswith("models/server.npy")), None)
                if log_name and model_name:
                    return zf.read(log_name).decode(errors="replace"), np.load(io.BytesIO(zf.read(model_name)))
    raise BenchmarkFailed(f"NVFlare POC {case.name}: no server log.txt + models/server.npy in {found}")


# --- ours: the real scheduler ----------------------------------------------------------------------------


def run_ours(stack: Any, variant: str, case: JobCase, store: Path, trainer: Any, split: Any) -> PocRun:
    from safetensors.numpy import load_file

    from flare_airflow.core.store import path_from_uri

    submitted = time.time()
    run_id = str(
        stack.api("POST", f"/dags/{case.dag_id}/dagRuns", json={"logical_date": None, "conf": {}})["dag_run_id"]
    )
    state = "queued"
    body: dict[str, Any] = {}
    while time.time() - submitted < RUN_TIMEOUT:
        body = stack.api("GET", f"/dags/{case.dag_id}/dagRuns/{run_id}")
        state = str(body["state"])
        if state in ("success", "failed"):
            break
        time.sleep(POLL)
    finished = time.time()
    tis = stack.task_instances(case.dag_id, run_id)
    bad = {t: ti["state"] for t, ti in tis.items() if ti["state"] != "success"}
    missing = case.expected_tasks() - set(tis)
    if state != "success" or bad or missing:
        raise BenchmarkFailed(
            f"{variant} {case.name} run {run_id}: state {state}; tasks not successful {bad}; missing {sorted(missing)} "
            f"(logs under {stack.home / 'logs'})"
        )
    round_starts, round_ends = [], []
    for r in range(1, case.rounds + 1):
        starts = [_ts(ti["start_date"]) for t, ti in tis.items() if t.startswith(f"round_{r}.") and ".site-" in t]
        end = _ts(tis[f"round_{r}.global_model"]["end_date"])
        if not starts or any(s is None for s in starts) or end is None:
            raise BenchmarkFailed(f"{variant} {case.name} run {run_id}: round {r} lacks timestamps")
        round_starts.append(min(s for s in starts if s is not None))
        round_ends.append(end)
    inner_start, inner_end = _ts(body.get("start_date")), _ts(body.get("end_date"))
    pointer = json.loads((store / case.name / "latest.json").read_text())
    if pointer.get("run_id") not in (None, run_id):
        raise BenchmarkFailed(f"{variant} {case.name}: latest.json names run {pointer.get('run_id')}, not {run_id}")
    final = load_file(str(Path(path_from_uri(pointer["model_uri"]))))
    for ti in tis.values():
        ti["log_marks"] = task_log_marks(stack.home / "logs", case.dag_id, run_id, ti)
    run = PocRun(
        variant,
        case,
        finished - submitted,
        (inner_end - inner_start) if inner_start and inner_end else float("nan"),
        round_starts,
        round_ends,
        final,
        tis=list(tis.values()),
        marks={"submitted": submitted, "finished": finished},
    )
    _check_final(run, trainer, split)
    return run


def task_log_marks(logs: Path, dag_id: str, run_id: str, ti: dict[str, Any]) -> dict[str, float]:
    """Wall-clock marks inside one task process, from its JSON task log: the Task SDK's first line,
    the DAG re-parse's duration, our operator's command (site runner + trainer) start and end, the last line."""
    path = (
        logs / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={ti['task_id']}" / f"attempt={ti['try_number']}.log"
    )
    marks: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rec = json.loads(line)
                ts = datetime.datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
                event = str(rec.get("event", ""))
                marks.setdefault("first", ts)
                marks["last"] = ts
                if event == "Worker startup parse complete":
                    marks["parse_s"] = float(rec["dag_file_parse_ms"]) / 1000
                    marks["parsed"] = ts
                elif event.startswith("Running command:"):
                    marks["command_start"] = ts
                elif event.startswith("site job ") and "runner_started" not in marks:
                    marks["runner_started"] = ts
                elif event.startswith("Command exited with return code"):
                    marks["command_end"] = ts
                elif event == "::group::Post Execute":
                    marks["post"] = ts
    return marks


def _check_final(run: PocRun, trainer: Any, split: Any) -> None:
    import numpy as np

    where = f"{run.system} {run.case.name}"
    if run.case.kind == "hello":
        got = np.asarray(run.final[HELLO_KEY])
        want = bench_nvflare._hello_initial() + run.case.rounds
        if got.shape != want.shape or not np.array_equal(got, want):
            raise BenchmarkFailed(f"{where}: final model {got.tolist()} != initial + {run.case.rounds}")
        return
    _, acc = trainer.loss_and_accuracy(run.final["weight"], run.final["bias"], split[1], split[3])
    run.accuracy = float(acc)


def idle_cores(stacks: dict[str, Any], poc: Poc, seconds: float = 15.0) -> dict[str, float]:
    """Cores each idle component uses (its whole session: forked workers included), over ``seconds``."""
    import bench_scale

    components = {
        f"{variant} {name}": proc.pid
        for variant, stack in stacks.items()
        for name, proc in zip(("api-server", "scheduler", "dag-processor"), stack.procs, strict=True)
    }
    if poc.pgid is not None:
        components[f"NVFlare POC ({poc.n} clients: server + clients)"] = poc.pgid
    time.sleep(3)
    before = bench_scale.cpu_sample(components)
    time.sleep(seconds)
    after = bench_scale.cpu_sample(components)
    wall = after.wall - before.wall
    return {c: (after.sessions[c] - before.sessions[c]) / wall for c in components}


def start_stacks(root: Path, store: Path) -> tuple[dict[str, Any], list[Any]]:
    sys.path.insert(0, str(REPO))
    from flare_airflow_testing.stack import AirflowStack, Postgres

    stacks: dict[str, Any] = {}
    owned: list[Any] = []
    for variant in VARIANTS:
        pg = Postgres()
        owned.append(pg)
        env = variant_env(variant)
        parallelism = int(env.pop("AIRFLOW__CORE__PARALLELISM"))
        stack = AirflowStack(root / variant, pg.url, parallelism=parallelism, extra_env=env)
        owned.append(stack)
        bench_nvflare.write_our_dags(stack.dags, store / variant)
        if variant == "ours-tuned":
            (stack.home / "config").mkdir(exist_ok=True)
            (stack.home / "config" / "airflow_local_settings.py").write_text(documented_local_settings())
        stacks[variant] = stack
    for variant, stack in stacks.items():
        started = time.monotonic()
        stack.start()
        for case in (HELLO_R1, HELLO_R3, HELLO_R10, DIGITS):
            stack.wait_for_dag(case.dag_id, timeout=180)
            stack.api("PATCH", f"/dags/{case.dag_id}", json={"is_paused": False})
        log(f"[poc] {variant}: Airflow up, DAGs serialised and unpaused in {time.monotonic() - started:.0f}s")
    return stacks, owned


def stop_owned(owned: list[Any]) -> None:
    from flare_airflow_testing.stack import AirflowStack

    for thing in reversed(owned):
        with contextlib.suppress(Exception):
            if isinstance(thing, AirflowStack):
                thing.stop()
    for thing in owned:
        with contextlib.suppress(Exception):
            if not isinstance(thing, AirflowStack):
                thing.stop()


# --- the benchmark ----------------------------------------------------------------------------------------


def run(*, reps: int, quick: bool, keep: bool, tmp_base: str | None) -> list[Table]:
    nv = bench_nvflare.ensure_nvflare_venv()
    root = Path(tempfile.mkdtemp(prefix="flare-bench-poc-", dir=tmp_base))
    root.chmod(0o755)
    store = root / "store"
    trainer = bench_nvflare._load_trainer()
    digits = bench_nvflare._digits_settings()
    split = trainer.load_split(trainer.parse_args(digits["trainer"].get("args", [])).seed)
    cases = [HELLO_R1] if quick else [HELLO_R1, HELLO_R3, HELLO_R10, DIGITS]
    runs: dict[tuple[str, str], list[PocRun]] = {}
    info: dict[str, Any] = {"poc_start": {}, "leftovers": []}
    owned: list[Any] = []
    ok = False
    try:
        jobs = export_jobs(nv, root / "nvflare", cases, trainer)
        started = time.monotonic()
        stacks, owned = start_stacks(root / "airflow", store)
        info["stacks_s"] = time.monotonic() - started
        count = 0
        for n in sorted({c.sites for c in cases}):
            group = [c for c in cases if c.sites == n]
            poc = Poc(nv, root / f"poc-{n}", n)
            poc.prepare()
            try:
                poc.start()
                info["poc_start"][n] = poc.start_s
                log(f"[poc] NVFlare POC with {n} clients up in {poc.start_s:.0f}s ({poc.prod})")
                if "idle" not in info:
                    info["idle"] = idle_cores(stacks, poc)

                def one(system: str, case: JobCase) -> PocRun:
                    nonlocal count
                    count += 1
                    if system == "nvflare":
                        return run_nvflare(poc, case, jobs[case.name], count, trainer, split)  # noqa: B023
                    return run_ours(stacks[system], system, case, store / system, trainer, split)

                for system in SYSTEMS:  # untimed: first job of each system on this group
                    warm = one(system, group[0])
                    log(f"[poc] warm-up {system} {group[0].name}: {warm.whole:.1f}s")
                pairs = [(s, c) for c in group for s in SYSTEMS]
                for rep in range(reps):
                    for system, case in rotate(pairs, rep):
                        r = one(system, case)
                        runs.setdefault((system, case.name), []).append(r)
                        log(
                            f"[poc] rep {rep + 1}/{reps} {system:12s} {case.name}: whole {r.whole:.2f}s, "
                            f"per round {r.per_round:.2f}s"
                        )
            finally:
                poc.stop()
                info["leftovers"] += poc.leftovers
        ok = True
    finally:
        stop_owned(owned)
        if keep or not ok:
            log(f"[poc] kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return tables(runs, cases, info, reps)


def _cell(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(median(values))} ({spread(values, fmt)})"


def _ratio(ours: list[float], theirs: list[float]) -> tuple[float, str]:
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return median(ratios), f"**{median(ratios):.2f}** ({spread(ratios)})"


def tables(
    runs: dict[tuple[str, str], list[PocRun]], cases: list[JobCase], info: dict[str, Any], reps: int
) -> list[Table]:
    def get(system: str, case: JobCase, what: str) -> list[float]:
        return [float(getattr(r, what)) for r in runs[(system, case.name)]]

    per_round = Table(
        "Per round: (end of the last round's aggregation - start of round 1) / rounds, seconds",
        ["job", *(LABEL[s] for s in SYSTEMS), "**default / NVFlare**", "**tuned / NVFlare**", "goal"],
    )
    whole = Table(
        "Whole run: trigger (REST) / submit (admin API) -> terminal state seen through the API, seconds",
        [
            "job",
            *(LABEL[s] for s in SYSTEMS),
            "**default / NVFlare**",
            "**tuned / NVFlare**",
            "inside: ours run start->end, NVFlare job log first line->Finished FedAvg (default / tuned / NVFlare)",
        ],
    )
    for case in cases:
        ratios = [_ratio(get(v, case, "per_round"), get("nvflare", case, "per_round")) for v in VARIANTS]
        per_round.add(
            case.label,
            *(_cell(get(s, case, "per_round")) for s in SYSTEMS),
            *(r[1] for r in ratios),
            f"<= {TARGET}: " + ("met (tuned)" if ratios[1][0] <= TARGET else "**not met**"),
        )
        w_ratios = [_ratio(get(v, case, "whole"), get("nvflare", case, "whole")) for v in VARIANTS]
        whole.add(
            case.label,
            *(_cell(get(s, case, "whole")) for s in SYSTEMS),
            *(r[1] for r in w_ratios),
            " / ".join(f"{median(get(s, case, 'inner')):.2f}" for s in SYSTEMS),
        )
    per_round.notes += [
        f"Median of {reps} repetitions (min-max); ratios are per repetition (runs of the same repetition), then the "
        "median. Ours: a round starts at its first site task's `start_date` and ends at its `global_model` task's "
        "`end_date` (task instances from the REST API). NVFlare: a round starts at the server job log's `Round k "
        "started.` and the last one ends at `Finished FedAvg.`.",
    ]
    whole.notes += [
        f"Both sides poll every {POLL} s through their own API (ours: `GET /api/v2/dags/{{id}}/dagRuns/{{run}}`; "
        "NVFlare: `Session.get_job_meta`) after a login made before the clock starts. NVFlare's job is over for "
        "its API only after the job process has ended and the server has collected the clients' job processes.",
    ]

    r2r = Table(
        "Round to round (start of round k -> start of round k+1) and one round's span (ours: first site start -> "
        "global_model end; NVFlare: `Round k started.` -> next round / Finished), median over rounds and runs, seconds",
        ["job", *(f"{LABEL[s]}: round to round" for s in SYSTEMS), *(f"{LABEL[s]}: span" for s in SYSTEMS)],
    )
    for case in cases:
        r2r.add(
            case.label,
            *(
                f"{median(v):.2f}" if (v := [x for r in runs[(s, case.name)] for x in r.round_to_round]) else "-"
                for s in SYSTEMS
            ),
            *(f"{median([x for r in runs[(s, case.name)] for x in r.round_spans]):.2f}" for s in SYSTEMS),
        )

    acc = [c for c in cases if c.kind == "digits"]
    checks = Table("Checks", ["what", "result"])
    checks.add(
        "task instances", "every task instance of every run of ours `success` (asserted), all expected tasks present"
    )
    checks.add("hello final models", "initial + rounds exactly, every run, all three ways (asserted)")
    checks.add("NVFlare rounds", "every round aggregated from all sites (`Aggregated N/N results` per round; asserted)")
    for case in acc:
        checks.add(
            "digits final test accuracy",
            " / ".join(f"{LABEL[s]} {median([r.accuracy or 0 for r in runs[(s, case.name)]]):.4f}" for s in SYSTEMS),
        )
    checks.add(
        "NVFlare POC start (untimed)",
        ", ".join(f"{n} clients {s:.0f} s" for n, s in info["poc_start"].items())
        + f"; both Airflow deployments (PostgreSQL, migrate, start, DAGs serialised) {info.get('stacks_s', 0):.0f} s",
    )
    if info.get("idle"):
        checks.add(
            "idle CPU before the first run (cores)",
            "; ".join(f"{name} {cores:.3f}" for name, cores in info["idle"].items()),
        )
    checks.add(
        "processes left after `nvflare poc stop`",
        "none" if not info["leftovers"] else f"{len(info['leftovers'])} killed by id: {'; '.join(info['leftovers'])}",
    )

    settings = Table(
        "Settings of the two flare-airflow deployments",
        ["setting", "Airflow default (ours-default)", "tuned (ours-tuned)", "why"],
    )
    for env_var, default, tuned, why in SETTINGS:
        section, key = env_var.split("__")[1:]
        settings.add(f"`[{section.lower()}] {key.lower()}`", default, tuned, why)
    settings.add(
        "`$AIRFLOW_HOME/config/airflow_local_settings.py`",
        "(none)",
        "`"
        + "; ".join(
            ln.split("#")[0].strip() for ln in documented_local_settings().splitlines() if ln.startswith("import")
        )
        + "` (docs/scale.md's block, read from the page)",
        "the scheduler imports the provider once; the LocalExecutor's workers are forks of it, so each task "
        "process re-parses the DAG file without importing the builder, operators and numpy (docs/scale.md)",
    )
    settings.notes.append(
        "Both: flare_airflow_testing/stack.py's deployment (private PostgreSQL with fsync off, api-server, "
        "scheduler with the LocalExecutor, dag-processor, each in its own session), running side by side during "
        "the whole benchmark next to NVFlare's POC system."
    )
    return [per_round, whole, r2r, profile_table(runs, cases), settings, checks]


STAGES = (
    ("react", "upstream task end -> queued (scheduler loop)"),
    ("qs", "queued -> running (executor, worker)"),
    ("boot", "running -> task log's first line (task process start-up, Task SDK)"),
    ("parse", "DAG file re-parse (`dag_file_parse_ms`)"),
    ("execute", "re-parse done -> site command start / aggregation done (operator)"),
    ("cmd", "site command: `bash -> python -m flare_airflow.site_task` -> trainer -> update written"),
    ("runner", "  of which: the site runner's start (bash + interpreter, until it starts the trainer)"),
    ("trainer", "  of which: the trainer's run + the runner's check of its update (a second interpreter)"),
    ("post", "command end / Post Execute -> task end (XCom, final state)"),
    ("total", "whole task instance (running -> success)"),
)


def _stages(ti: dict[str, Any], upstream_end: float | None) -> dict[str, float]:
    q, s, e = _ts(ti.get("queued_when")), _ts(ti.get("start_date")), _ts(ti.get("end_date"))
    m = ti.get("log_marks") or {}
    out: dict[str, float] = {}
    if q is None or s is None or e is None:
        return out
    if upstream_end is not None:
        out["react"] = q - upstream_end
    out["qs"], out["total"] = s - q, e - s
    if "first" in m:
        out["boot"] = m["first"] - s
    if "parse_s" in m:
        out["parse"] = m["parse_s"]
    if "parsed" in m and "command_start" in m and "command_end" in m:
        out["execute"] = m["command_start"] - m["parsed"]
        out["cmd"] = m["command_end"] - m["command_start"]
        if "runner_started" in m:
            out["runner"] = m["runner_started"] - m["command_start"]
            out["trainer"] = m["command_end"] - m["runner_started"]
        out["post"] = e - m["command_end"]
    elif "parsed" in m and "post" in m:
        out["execute"] = m["post"] - m["parsed"]
        out["post"] = e - m["post"]
    return out


def profile_table(runs: dict[tuple[str, str], list[PocRun]], cases: list[JobCase]) -> Table:
    """Where a round's time goes under the scheduler, from the task instances and their task logs."""
    kinds = sorted({c.kind for c in cases}, key=lambda k: k != "hello")
    columns = [(k, v, role) for k in kinds for role in ("site", "agg") for v in VARIANTS]
    header = ["stage"] + [
        f"{k}: {'site task' if role == 'site' else 'global_model'}, {'default' if v == 'ours-default' else 'tuned'}"
        for k, v, role in columns
    ]
    table = Table("Where a round goes under the scheduler (median over task instances of all runs, seconds)", header)
    values: dict[tuple[str, str, str], dict[str, list[float]]] = {c: {} for c in columns}
    for case in cases:
        for variant in VARIANTS:
            for run in runs[(variant, case.name)]:
                tis = {t["task_id"]: t for t in run.tis}
                prev_end = _ts(tis["prepare"]["end_date"])
                for r in range(1, case.rounds + 1):
                    sites = [t for k, t in tis.items() if k.startswith(f"round_{r}.") and ".site-" in k]
                    agg = tis[f"round_{r}.global_model"]
                    for t in sites:
                        for key, val in _stages(t, prev_end).items():
                            values[(case.kind, variant, "site")].setdefault(key, []).append(val)
                    last_site = max((_ts(t["end_date"]) or 0.0) for t in sites)
                    for key, val in _stages(agg, last_site).items():
                        values[(case.kind, variant, "agg")].setdefault(key, []).append(val)
                    prev_end = _ts(agg["end_date"])
    for key, label in STAGES:
        table.add(label, *(f"{median(v):.2f}" if (v := values[c].get(key)) else "-" for c in columns))
    table.notes += [
        "Timestamps: `queued_when`, `start_date`, `end_date` of the task instances (REST API) and the JSON lines of "
        "each task's log (the Task SDK's own `Worker startup parse complete` with `dag_file_parse_ms`; the "
        "SubprocessHook's `Running command` and `Command exited`; `::group::Post Execute`). A round = its site tasks "
        "(in parallel) + the scheduler's reaction + its `global_model` task. 'upstream task end' is the previous "
        "round's `global_model` (round 1: `prepare`) for a site task, the round's last site task for `global_model`.",
    ]
    return table
