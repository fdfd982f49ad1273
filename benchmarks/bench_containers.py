"""A container site's cost next to a process site's and a pod site's: the same digits trainer,
side by side in one run -- a federated round through Airflow, and one site job through its launcher.

1. **Rounds through Airflow.** One real deployment (``flare_airflow_testing.stack``: a private PostgreSQL,
   api-server, scheduler with the LocalExecutor, dag-processor) and three DAGs of the digits demo job
   (dags/digits.yaml, 4 sites), all sites process, all sites container, all sites pod. Runs of 3
   rounds alternate; the per-round figure is rounds 2 and 3 of each run, from the end of the previous
   round's aggregation task to the end of this round's.
2. **One site job through its launcher** (the harshest view: no Airflow around it), from
   ``launch_job`` until ``wait`` returned SUCCESS and nothing of the job is left (container removed,
   pod deleted):

   * **process site**: ``ProcessLauncher``, the trainer as a local process.
   * **container site**: ``ContainerLauncher`` on rootful podman with the project's trainer image
     (``docker/images.py``): the engine's ``run`` attached, then ``rm`` (two engine calls).
   * **container site, before**: the same container with the engine calls the launcher made before
     (``run --detach``, ``wait``, ``inspect``, ``logs``, ``rm``), for the side-by-side ratio.
   * **floors**: ``python -c pass`` as a process, a bare ``podman run --rm``, and the launcher's own
     ``run`` argv + ``rm`` with ``python -c pass`` as the trainer.

Both pod cases use a real kube-apiserver (v1.20.2, started here) with the project's LOCAL NODE AGENT
test harness as the node: it runs the pod's command as a local process, so a pod row is the
Kubernetes API's share, not a container runtime's. The goal (issue 27): a container site's round
within 1.5x a process site's.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import BenchmarkFailed, Table, log, median, rotate, spread
from bench_scale import stop_stack
from safetensors.numpy import load_file

from flare_airflow.core.config import ContainerLaunchSpec, KubernetesLaunchSpec, ResourceSpec
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobIdentity, JobReturnCode, SiteJob
from flare_airflow.launchers.container import ContainerLauncher, container_name, map_container, run_command
from flare_airflow.launchers.process import ProcessLauncher

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "examples" / "digits" / "trainer.py"
ARGS = ["--num-sites", "4", "--alpha", "0.5", "--seed", "0"]
HPARAMS = {"lr": 0.5, "local_epochs": 10, "batch_size": 16}
CONTAINER_BLOCK = {"pull": "never", "trainer_script": "/opt/trainer/trainer.py"}  # the image is built here
NAMESPACE = "bench-pods"
ROUNDS = 3  # per run: rounds 2 and 3 are timed, round 1 carries the run's start
PARALLELISM = 4  # the 4 site tasks of a round at once (INFRA.md: 4 on these machines)


def trainer_image() -> str:
    """The project's trainer image for this tree (``docker/images.py`` builds it when missing), by its
    image id: on an engine shared with other trees, their ``images.py`` untags the content-hash tags
    it does not keep (and podman's name filter matches more than the one name), which would take a
    tag away mid-run; an id stays."""
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, str(REPO / "docker" / "images.py"), "--engine", "podman", "trainer"],
            capture_output=True, text=True, timeout=1200, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise BenchmarkFailed(f"docker/images.py failed: {proc.stderr[-2000:]}")
        built = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)["trainer"]
        inspected = subprocess.run(
            ["podman", "image", "inspect", "--format", "{{.Id}}", built],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if inspected.returncode == 0:
            log(f"[containers] trainer image {built} = {inspected.stdout.strip()[:12]}")
            return inspected.stdout.strip()
    raise BenchmarkFailed(f"the trainer image's tag was taken away three times: {inspected.stderr.strip()}")


def _job(store: Path, case: str, rep: int, argv: list[str]) -> SiteJob:
    staging = store / case / f"rep-{rep}"
    staging.mkdir(parents=True)
    env = {
        "FLARE_JOB": "bench", "FLARE_RUN_ID": f"{case}-{rep}", "FLARE_SITE": "site-1", "FLARE_ROUND": "1",
        "FLARE_TOTAL_ROUNDS": "1", "FLARE_TASK": "train", "FLARE_HPARAMS": json.dumps(HPARAMS),
        "FLARE_GLOBAL_MODEL": str(store / "global" / "model.safetensors"),
        "FLARE_OUTPUT": str(staging / "update.safetensors"),
    }  # fmt: skip
    return SiteJob("bench", f"{case}-{rep}", 1, "site-1", argv=tuple(argv), env=env)


class DetachedBefore:
    """The container launcher's engine calls before they were cut: ``run --detach``, ``wait``,
    ``inspect``, ``logs``, ``rm`` -- the same container (one builder), for the side-by-side ratio."""

    def __init__(self, launcher: ContainerLauncher) -> None:
        self.launcher = launcher

    def run(self, job: SiteJob) -> tuple[JobReturnCode, str]:
        engine = self.launcher.engine
        self.launcher._writable_staging(job)
        argv, env = run_command(self.launcher.spec, None, job, JobIdentity.of(job, 1), environ=self.launcher.environ)
        argv = ["--detach" if a == "--sig-proxy=false" else a for a in argv]
        container = engine(*argv[1:], env=env).strip()
        engine("wait", container, timeout=300)
        state = json.loads(engine("inspect", "--format", "{{json .State}}", container))
        engine("logs", container)
        engine("rm", "--force", container)
        status = map_container(state, terminated=False)
        return status.return_code, status.reason


def _floor(calls: list[list[str]]) -> float:
    """Wall time of bare starts and exits, one after the other: no trainer, no launcher -- the
    machine's and the engine's own cost."""
    started = time.monotonic()
    for argv in calls:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise BenchmarkFailed(f"{' '.join(argv[:3])} ... exited {done.returncode}: {done.stderr[-2000:]}")
    return time.monotonic() - started


def _timed(launcher: ContainerLauncher | ProcessLauncher | DetachedBefore | Any, job: SiteJob) -> tuple[float, str]:
    started = time.monotonic()
    if isinstance(launcher, DetachedBefore):
        rc, reason = launcher.run(job)
    else:
        handle = launcher.launch_job(job)
        rc = handle.wait(300)
        reason = handle.reason
    elapsed = time.monotonic() - started
    if rc is not JobReturnCode.SUCCESS:
        raise BenchmarkFailed(f"{job.run_id}: {rc.name} {reason}")
    update = Path(job.env["FLARE_OUTPUT"]).read_bytes()
    return elapsed, hashlib.sha256(update).hexdigest()


@contextlib.contextmanager
def cluster(base: Path) -> Iterator[tuple[Any, str]]:
    """A fresh control plane (kube-apiserver v1.20.2 and its scheduler and controller-manager) with
    the LOCAL NODE AGENT as its node, and a namespace of its own: ``(control plane, namespace)``."""
    from kubernetes import client as k8s

    from flare_airflow_testing.k8s.control_plane import ControlPlane
    from flare_airflow_testing.k8s.kube import wait_for
    from flare_airflow_testing.k8s.node_agent import NodeAgent

    cp = ControlPlane(base / "control-plane").start()
    agent = None
    try:
        agent = NodeAgent(kubeconfig=cp.kubeconfig_path("node"), node_name="bench-node", work_dir=base / "node").start()
        core = k8s.CoreV1Api(cp.api_client())
        core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=NAMESPACE)))
        wait_for(lambda: core.list_namespaced_service_account(NAMESPACE).items, 30, what="default SA")
        yield cp, NAMESPACE
    finally:
        if agent is not None:
            agent.stop()
        cp.stop()


def pod_block(namespace: str, store: Path, **extra: Any) -> dict[str, Any]:
    """A pod site's ``launcher_spec.k8s``: the node agent runs the pod's command on this machine, so
    the image is not pulled and its interpreter and script are this repository's."""
    return {
        "namespace": namespace,
        "image": "registry.example.org/fl/trainer:1",
        "trainer_command": [sys.executable],
        "trainer_script": str(TRAINER),
        "store_mount": {"host_path": str(store), "mount_path": "/flare-store"},
        **extra,
    }


# ---------------------------------------------------------------- rounds through Airflow


def _write_round_job(folder: Path, dag_id: str, store: Path, site: dict[str, Any]) -> None:
    """The digits demo job (dags/digits.yaml: 4 sites, 10 local epochs, evaluation of each round's
    global model) with every site's launcher set to ``site``."""
    import yaml

    job = yaml.safe_load((REPO / "dags" / "digits.yaml").read_text())
    job.update(job=dag_id.replace("_", "-"), rounds=ROUNDS, store=str(store))
    job["initial_model"] = str(REPO / "examples" / "digits" / "initial_model.safetensors")
    job["trainer"]["script"] = str(TRAINER)
    for name in [s for s in job["sites"] if not s.startswith("@")]:
        job["sites"][name] = dict(site)
    (folder / f"{dag_id}.yaml").write_text(json.dumps(job, indent=1) + "\n")
    (folder / f"{dag_id}_dag.py").write_text(
        "from pathlib import Path\n\nfrom flare_airflow.builder import build_dag\n\n"
        f'dag = build_dag(Path(__file__).with_name("{dag_id}.yaml"), dag_id="{dag_id}")\n'
    )


def _when(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp).timestamp()


def _timed_run(stack: Any, dag_id: str, rounds: int = ROUNDS) -> tuple[float, list[float], list[float]]:
    """Trigger to end of a run of ``rounds`` rounds; the rounds after the first (each from the end of
    the previous round's aggregation to the end of its own); the site task instances' durations."""
    started = time.monotonic()
    run_id = stack.trigger(dag_id, {"rounds": rounds})
    state = stack.wait_for_run(dag_id, run_id, timeout=900)
    elapsed = time.monotonic() - started
    tis = stack.task_instances(dag_id, run_id)
    # A run of fewer rounds than the job's skips the later rounds' tasks; every other task must succeed.
    ended = {ti["state"] for ti in tis.values()} - ({"skipped"} if rounds < ROUNDS else set())
    if state != "success" or ended != {"success"}:
        raise BenchmarkFailed(f"{dag_id} run {run_id}: {state}; { ({t: ti['state'] for t, ti in tis.items()}) }")
    ends = [_when(tis[f"round_{r}.global_model"]["end_date"]) for r in range(1, rounds + 1)]
    rounds = [b - a for a, b in itertools.pairwise(ends)]
    sites = [float(ti["duration"]) for t, ti in tis.items() if ".site-" in t and ti["state"] == "success"]
    return elapsed, rounds, sites


def round_cases(image: str, namespace: str, store: Path, kubeconfig: Path) -> dict[str, dict[str, Any]]:
    """The site spec of every site, per case: all process, all container, all pod."""
    return {
        "process sites": {"launcher": "process"},
        "container sites (podman)": {
            "launcher": "container",
            "launcher_spec": {"container": CONTAINER_BLOCK | {"image": image}},
        },
        "pod sites (kube-apiserver + LOCAL NODE AGENT)": {
            "launcher": "k8s",
            "launcher_spec": {"k8s": pod_block(namespace, store, config_file=str(kubeconfig))},
        },
    }


Timed = Callable[[str, int], tuple[float, list[float], list[float]]]


@dataclass
class CaseRuns:
    """One case's timed runs: each run's wall time, each timed round, each site task's duration."""

    walls: list[float] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)
    site_tasks: list[float] = field(default_factory=list)


def _alternating_runs(names: list[str], reps: int, timed: Timed, label: str) -> dict[str, CaseRuns]:
    """``timed(case, rounds)`` once per case untimed (first parse, first imports), then ``reps`` runs of
    ``ROUNDS`` rounds per case, cases alternating."""
    for name in names:
        timed(name, 1)
    runs = {name: CaseRuns() for name in names}
    for rep in range(reps):
        for name in rotate(names, rep):
            elapsed, rounds, sites = timed(name, ROUNDS)
            runs[name].walls.append(elapsed)
            runs[name].rounds.extend(rounds)
            runs[name].site_tasks.extend(sites)
            log(f"[containers] {label} {name} rep {rep + 1}: {elapsed:.1f} s, rounds {[f'{r:.1f}' for r in rounds]}")
    return runs


def _round_table(title: str, runs: dict[str, CaseRuns]) -> Table:
    """Per case: the median round, its spread, its ratio to the process sites', the site tasks, the runs."""
    table = Table(
        title,
        ["sites", "per round, median s", "spread s", "x process", "site task, median s", f"run of {ROUNDS} rounds, s"],
    )
    base = median(runs["process sites"].rounds)
    for name, case in runs.items():
        table.add(
            name,
            f"{median(case.rounds):.1f}",
            spread(case.rounds, "{:.1f}"),
            f"{median(case.rounds) / base:.2f}",
            f"{median(case.site_tasks):.2f}",
            f"{median(case.walls):.1f}",
        )
    return table


def embedded_table(reps: int, root: Path, image: str, namespace: str, kubeconfig: Path) -> Table:
    """The same three jobs on the embedded default: ``flare-airflow run`` (``airflow dags test`` on
    SQLite, every task in one process, one after another); runs alternate."""
    from flare_airflow_testing.harness import AirflowHome

    home = AirflowHome(root)
    store = root / "store"
    store.mkdir()
    cases = round_cases(image, namespace, store, kubeconfig)
    dag_ids = {name: f"embedded_{i}" for i, name in enumerate(cases)}
    for name, site in cases.items():
        _write_round_job(home.dags, dag_ids[name], store, site)

    def timed(name: str, rounds: int) -> tuple[float, list[float], list[float]]:
        started = time.monotonic()
        result = home.run(dag_ids[name], conf={"rounds": rounds})
        elapsed = time.monotonic() - started
        tasks = result.state["tasks"]
        ended = {t["state"] for t in tasks.values()} - ({"skipped"} if rounds < ROUNDS else set())
        if result.returncode != 0 or ended != {"success"}:
            raise BenchmarkFailed(f"{dag_ids[name]}: {result.tasks}; {result.log[-2000:]}")
        ends = [_when(tasks[f"round_{r}.global_model"]["end_date"]) for r in range(1, rounds + 1)]
        sites = [float(t["duration"]) for tid, t in tasks.items() if ".site-" in tid and t["state"] == "success"]
        return elapsed, [b - a for a, b in itertools.pairwise(ends)], sites

    table = _round_table(
        "One federated round of the digits job on the embedded default (`flare-airflow run`: `airflow dags "
        "test`, SQLite, tasks one after another): all sites process vs all container vs all pod",
        _alternating_runs(list(cases), reps, timed, "embedded"),
    )
    table.notes.append(
        "A round as in the table above (rounds 2..N, from one aggregation task's end to the next's), here "
        "with the 4 site tasks run one after another in the `dags test` process (no task-process start-up, "
        f"no DAG parse per task); {reps} runs of {ROUNDS} rounds per case after one untimed run each, "
        "cases alternating."
    )
    return table


def rounds_table(reps: int, root: Path, image: str, namespace: str, kubeconfig: Path) -> Table:
    """The same digits job with all sites process, all container, all pod, under Airflow's real
    scheduler; runs alternate."""
    from flare_airflow_testing.stack import AirflowStack, Postgres

    store = root / "store"
    store.mkdir(parents=True)
    cases = round_cases(image, namespace, store, kubeconfig)
    dag_ids = {name: f"rounds_{i}" for i, name in enumerate(cases)}
    pg = stack = None
    try:
        pg = Postgres()
        stack = AirflowStack(root / "stack", pg.url, parallelism=PARALLELISM)
        for name, site in cases.items():
            _write_round_job(stack.dags, dag_ids[name], store, site)
        stack.start()
        log("[containers] PostgreSQL + Airflow up")
        runs = _alternating_runs(list(cases), reps, lambda name, n: _timed_run(stack, dag_ids[name], n), "scheduler")
    finally:
        stop_stack(stack, pg)
    table = _round_table(
        f"One federated round of the digits job (4 sites, 10 local epochs) under Airflow's real scheduler "
        f"(PostgreSQL, LocalExecutor, parallelism {PARALLELISM}): all sites process vs all container vs all pod",
        runs,
    )
    table.notes.append(
        "A round is rounds 2..N of each run: from the end of the previous round's aggregation task to the end "
        "of this round's -- the scheduler starting the round's 4 site task instances (LocalExecutor task "
        "processes), each site task's whole lifecycle (policy, staging the global model, the site job through "
        "its launcher, accepting the update), then the aggregation task (FedAvg over the 4 updates, evaluation "
        "of the new global model by the trainer script on the worker, publishing it). Round 1 (after `prepare`) "
        "and the run's fixed tasks are left out; 'site task' is Airflow's duration of the round tasks of every "
        f"site; {reps} runs of {ROUNDS} rounds per case after one untimed run each, cases alternating."
    )
    table.notes.append(
        "The pod sites' node is the LOCAL NODE AGENT test harness (the trainer runs as a local process, no "
        "image): their row is the Kubernetes API's share of a round with the site default poll interval (2 s), "
        "not a container runtime's. The container sites run the project's trainer image under rootful podman "
        "with the launcher's security defaults."
    )
    return table


# ---------------------------------------------------------------- one site job through its launcher


def _exact_flags_floor(
    launcher: ContainerLauncher, store: Path, case: str, rep: int, *, remove_after: bool
) -> list[list[str]]:
    """The engine calls of a container site job whose trainer is ``python -c pass``: the launcher's
    own ``run`` argv (every security option, labels, mounts, cidfile) and its ``rm`` -- or, without
    ``remove_after``, that ``run`` with ``--rm`` (the engine removes the container itself)."""
    job = _job(store, case, rep, ["python", "-c", "pass"])
    launcher._writable_staging(job)
    identity = JobIdentity.of(job, 1)
    cidfile = Path(job.env["FLARE_OUTPUT"]).with_name("job.cid")
    argv, _ = run_command(launcher.spec, None, job, identity, environ=launcher.environ, cidfile=str(cidfile))
    if not remove_after:
        return [[argv[0], "run", "--rm", *argv[2:]]]
    return [argv, [launcher.spec.engine, "rm", "--force", container_name(identity)]]


def job_table(reps: int, store: Path, image: str, cp: Any, namespace: str) -> Table:
    from flare_airflow.launchers.kubernetes import KubernetesLauncher

    model = store / "global" / "model.safetensors"
    model.parent.mkdir(parents=True)
    write_artifact(model, FLModel(params=load_file(str(REPO / "examples" / "digits" / "initial_model.safetensors"))))
    process = ProcessLauncher(sink=lambda line: None)
    container = ContainerLauncher(ContainerLaunchSpec.model_validate(CONTAINER_BLOCK | {"image": image}))
    pod_spec = KubernetesLaunchSpec.model_validate(pod_block(namespace, store))
    pods = KubernetesLauncher(pod_spec, ResourceSpec(), store_root=str(store), api_client=cp.api_client())
    in_image = ["python", "/opt/trainer/trainer.py", *ARGS]
    on_host = [sys.executable, str(TRAINER), *ARGS]
    cases = {
        "process site": (process, on_host),
        "container site (podman: run attached, rm)": (container, in_image),
        "container site, before (run -d, wait, inspect, logs, rm)": (DetachedBefore(container), in_image),
        "pod site (kube-apiserver + LOCAL NODE AGENT)": (pods, on_host),
    }
    # The machine's and the engine's own floors: what no launcher can cut.
    bare = "floor: `podman run --rm` of the image, `python -c pass`"
    exact = "floor: the launcher's `podman run` argv + `rm`, `python -c pass`"
    exact_rm = "floor: the launcher's `podman run` argv with `--rm` (no `rm` call), `python -c pass`"
    floors = {
        "floor: `python -c pass` as a process": [[sys.executable, "-c", "pass"]],
        bare: [
            ["podman", "run", "--rm", "--pull=never", "--network=none", "--read-only", "--cap-drop=all",
             "--security-opt=no-new-privileges", "--user=1000:1000", image, "python", "-c", "pass"],
        ],
        exact: [],
        exact_rm: [],
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in [*cases, *floors]}
    digests: dict[str, set[str]] = {name: set() for name in cases}
    for rep in range(reps):
        for index, name in rotate(list(enumerate([*cases, *floors])), rep):
            if name in floors:
                engine_argvs = floors[name] or _exact_flags_floor(
                    container, store, f"floor{index}", rep, remove_after=name == exact
                )
                seconds = _floor(engine_argvs)
            else:
                launcher, argv = cases[name]
                seconds, digest = _timed(launcher, _job(store, f"case{index}", rep, argv))
                digests[name].add(digest)
            times[name].append(seconds)
            log(f"[containers] {name} rep {rep + 1}: {seconds:.2f} s")
    base = median(times["process site"])
    table = Table(
        "One site job of the digits trainer (1 round, 10 local epochs) through its launcher: launch to accepted end",
        ["site", "engine calls", "median s", "spread s", "x process"],
    )
    calls = {"container site (podman": "2", "container site, before": "5", bare: "1", exact: "2", exact_rm: "1"}
    for name, values in times.items():
        engine_calls = next((n for prefix, n in calls.items() if name.startswith(prefix)), "-")
        table.add(name, engine_calls, f"{median(values):.2f}", spread(values), f"{median(values) / base:.2f}")
    same = len(set().union(*digests.values())) == 1
    engine_floor = median(times[exact]) - median(times["floor: `python -c pass` as a process"])
    table.notes.append(
        f"Bound: a container site job costs at least the process site's plus the engine's own start and "
        f"removal beyond a process's with the launcher's options ({engine_floor:.2f} s, the floor rows), i.e. "
        f"{(base + engine_floor) / base:.2f}x process on this machine whatever the launcher does."
    )
    table.notes.append(
        f"Of that, the launcher's options cost {median(times[exact_rm]) - median(times[bare]):+.2f} s over a bare "
        f"`podman run --rm` and its separate `rm` call {median(times[exact]) - median(times[exact_rm]):+.2f} s over "
        "`run --rm`. The `rm` call stays: a failed job's container is inspected once after it exited (OOM kill, "
        "engine error, never started), which `--rm` would have removed."
    )
    table.notes.append(
        f"{reps} repetitions per case, alternating. The update is {'bitwise the same' if same else 'NOT the same'} "
        f"from every case (sha256). Image {image}; the worker's OPENBLAS_* settings "
        f"({', '.join(k for k in os.environ if k.startswith('OPENBLAS_')) or 'none'}) are passed into the "
        "container. The pod site's node is the LOCAL NODE AGENT test harness (the trainer runs as a local "
        "process, no image): its row is the Kubernetes API's share of a site job; poll_interval "
        f"{pod_spec.poll_interval:g} s (the site default)."
    )
    return table


def _without(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value."""
    at = argv.index(option)
    return [*argv[:at], *argv[at + 2 :]]


def _with(argv: list[str], *options: str) -> list[str]:
    """``argv`` with ``options`` right after ``run``."""
    at = argv.index("run") + 1
    return [*argv[:at], *options, *argv[at:]]


# Engine options that might cost time without serving a security default, each next to the
# launcher's own ``run`` + ``rm``: (label, what it would give up, how the calls change). No variant
# drops a security option (user, read-only root, capabilities, no-new-privileges, network, pids).
OPTION_VARIANTS: list[tuple[str, str, Any]] = [
    ("the launcher's `run` + `rm` (as shipped)", "", lambda run, rm: [run, rm]),
    (
        "`--log-driver none`",
        "`logs` of a container found again",
        lambda run, rm: [_with(run, "--log-driver", "none"), rm],
    ),
    (
        "`--events-backend none` (podman only)",
        "podman's event log; docker has no such option",
        lambda run, rm: [[run[0], "--events-backend", "none", *run[1:]], [rm[0], "--events-backend", "none", *rm[1:]]],
    ),
    (
        "`--cgroups no-conmon`",
        "conmon in the container's cgroup (podman only)",
        lambda run, rm: [_with(run, "--cgroups", "no-conmon"), rm],
    ),
    ("`--no-hosts`", "an /etc/hosts naming the container", lambda run, rm: [_with(run, "--no-hosts"), rm]),
    (
        "no `--cidfile`",
        "the launch's proof that the container was created",
        lambda run, rm: [_without(run, "--cidfile"), rm],
    ),
    ("no `/tmp` tmpfs", "a writable /tmp on the read-only root", lambda run, rm: [_without(run, "--tmpfs"), rm]),
    (
        "`run --rm`, no `rm` call",
        "the exited container a failed job is inspected in",
        lambda run, rm: [_with(run, "--rm")],
    ),
]


def _engine_calls(calls: list[list[str]]) -> tuple[float, float]:
    """Wall time and CPU time (the engine's processes that are this one's children) of ``calls``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = _floor(calls)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def options_table(reps: int, store: Path, image: str) -> Table:
    """The launcher's own engine calls for a ``python -c pass`` trainer, with one engine option
    changed at a time; 4 x ``reps`` runs of each, alternating."""
    launcher = ContainerLauncher(ContainerLaunchSpec.model_validate(CONTAINER_BLOCK | {"image": image}))
    runs = 4 * reps
    wall: dict[str, list[float]] = {label: [] for label, _, _ in OPTION_VARIANTS}
    cpu: dict[str, list[float]] = {label: [] for label, _, _ in OPTION_VARIANTS}
    failed = dict.fromkeys(wall, 0)
    for rep in range(runs):
        for index, (label, _, change) in rotate(list(enumerate(OPTION_VARIANTS)), rep):
            run_argv, rm_argv = _exact_flags_floor(launcher, store, f"option{index}", rep, remove_after=True)
            try:
                seconds, cpu_seconds = _engine_calls(change(run_argv, rm_argv))
            except BenchmarkFailed as exc:
                # The engine is shared with other users of this machine: a refused call is counted and
                # shown, not silently dropped, and does not end the other tables' measurements.
                failed[label] += 1
                log(f"[containers] {label}: {exc}")
                subprocess.run(rm_argv, capture_output=True, timeout=120, check=False)
                continue
            wall[label].append(seconds)
            cpu[label].append(cpu_seconds)
        log(f"[containers] engine options, run {rep + 1}/{runs}")
    base_label = OPTION_VARIANTS[0][0]
    base_wall, base_cpu = median(wall[base_label]), median(cpu[base_label])
    table = Table(
        f"Engine options of a container site job (`python -c pass` as the trainer): the launcher's own `run` "
        f"and `rm` with one option changed; median of {runs}, alternating",
        ["variant", "gives up", "wall s", "wall spread s", "x shipped", "engine CPU s", "x shipped (CPU)", "failed"],
    )
    for label, gives_up, _ in OPTION_VARIANTS:
        table.add(
            label,
            gives_up or "-",
            f"{median(wall[label]):.2f}",
            spread(wall[label]),
            f"{median(wall[label]) / base_wall:.2f}",
            f"{median(cpu[label]):.3f}",
            f"{median(cpu[label]) / base_cpu:.2f}",
            failed[label],
        )
    table.notes.append(
        "Engine CPU is the user + system time of the engine's processes this benchmark started (podman and "
        "its runc; conmon, which daemonizes, is not counted): steadier than wall time on a loaded machine. "
        "Every variant keeps the security defaults (non-root user, read-only root, all capabilities dropped, "
        "no-new-privileges, network none, PID limit; a memory limit when the site sets one). An option is worth "
        "shipping only if it is clearly below the shipped row in both columns and gives up nothing a site needs."
    )
    return table


def run(reps: int = 3, keep: bool = False, tmp_base: str | None = None) -> list[Table]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    root = Path(tempfile.mkdtemp(prefix="flare-bench-containers-", dir=tmp_base))
    try:
        image = trainer_image()
        with cluster(root / "k8s") as (cp, namespace):
            return [
                rounds_table(reps, root / "rounds", image, namespace, cp.kubeconfig_path()),
                embedded_table(reps, root / "embedded", image, namespace, cp.kubeconfig_path()),
                job_table(reps, root / "jobs", image, cp, namespace),
                options_table(reps, root / "jobs", image),
            ]
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
