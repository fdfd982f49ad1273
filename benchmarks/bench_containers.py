"""One site job's cost on a container site next to a process site and a pod site: the same digits
trainer, one round, side by side in one run.

Each case goes through its launcher exactly as a site task does, from ``launch_job`` until ``wait``
returned SUCCESS and nothing of the job is left (container removed, pod deleted):

* **process site**: ``ProcessLauncher``, the trainer as a local process.
* **container site**: ``ContainerLauncher`` on rootful podman with the project's trainer image
  (``docker/images.py``): the engine's ``run`` attached, then ``rm`` (two engine calls).
* **container site, before**: the same container with the engine calls the launcher made before
  (``run --detach``, ``wait``, ``inspect``, ``logs``, ``rm``), for the side-by-side ratio.
* **pod site**: ``KubernetesLauncher`` against a real kube-apiserver (v1.20.2, started here) with the
  project's LOCAL NODE AGENT test harness as the node: it runs the pod's command as a local process,
  so this is the Kubernetes API's share of a site job, not a container runtime's.

The cases alternate within one run; the update of each case is checked (the same sha256 from every
backend). The goal (issue 27): a container site's job within 1.5x a process site's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_common import BenchmarkFailed, Table, log, median, rotate, spread

from flare_airflow.core.config import ContainerLaunchSpec, KubernetesLaunchSpec, ResourceSpec
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobIdentity, JobReturnCode, SiteJob
from flare_airflow.launchers.container import ContainerLauncher, map_container, run_command
from flare_airflow.launchers.process import ProcessLauncher

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "examples" / "digits" / "trainer.py"
ARGS = ["--num-sites", "4", "--alpha", "0.5", "--seed", "0"]
HPARAMS = {"lr": 0.5, "local_epochs": 10, "batch_size": 16}


def trainer_image() -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "docker" / "images.py"), "--engine", "podman", "trainer"],
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise BenchmarkFailed(f"docker/images.py failed: {proc.stderr[-2000:]}")
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)["trainer"]


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


def _floor(argv: list[str]) -> float:
    """Wall time of one bare start and exit: no trainer, no launcher -- the machine's own cost."""
    started = time.monotonic()
    subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=300, check=True)
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
def pod_launcher(base: Path, store: Path) -> Iterator[Any]:
    """A ``KubernetesLauncher`` on a fresh control plane with the LOCAL NODE AGENT as its node (the
    trainer runs as a local process; ``/opt/trainer`` is examples/digits), in a namespace of its own."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from kubernetes import client as k8s

    from flare_airflow.launchers.kubernetes import KubernetesLauncher
    from flare_airflow_testing.k8s.control_plane import ControlPlane
    from flare_airflow_testing.k8s.kube import wait_for
    from flare_airflow_testing.k8s.node_agent import NodeAgent

    cp = ControlPlane(base / "control-plane").start()
    agent = None
    try:
        agent = NodeAgent(kubeconfig=cp.kubeconfig_path("node"), node_name="bench-node", work_dir=base / "node").start()
        core = k8s.CoreV1Api(cp.api_client())
        core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name="bench-pods")))
        wait_for(lambda: core.list_namespaced_service_account("bench-pods").items, 30, what="default SA")
        spec = KubernetesLaunchSpec.model_validate(
            {
                "namespace": "bench-pods",
                "image": "registry.example.org/fl/trainer:1",  # not pulled: the node agent runs the command
                "trainer_command": [sys.executable],
                "trainer_script": "/opt/trainer/trainer.py",
                "store_mount": {"host_path": str(store), "mount_path": "/flare-store"},
                "volumes": [
                    {"name": "code", "mount_path": "/opt/trainer", "host_path": str(TRAINER.parent), "read_only": True}
                ],
            }
        )
        yield KubernetesLauncher(spec, ResourceSpec(), store_root=str(store), api_client=cp.api_client()), spec
    finally:
        if agent is not None:
            agent.stop()
        cp.stop()


def run(reps: int = 3, keep: bool = False, tmp_base: str | None = None) -> list[Table]:
    from safetensors.numpy import load_file

    image = trainer_image()
    store = Path(tempfile.mkdtemp(prefix="flare-bench-containers-", dir=tmp_base))
    try:
        model = store / "global" / "model.safetensors"
        model.parent.mkdir()
        write_artifact(
            model, FLModel(params=load_file(str(REPO / "examples" / "digits" / "initial_model.safetensors")))
        )
        process = ProcessLauncher(sink=lambda line: None)
        block = {"image": image, "pull": "never", "trainer_script": "/opt/trainer/trainer.py"}
        container = ContainerLauncher(ContainerLaunchSpec.model_validate(block))
        in_image = ["python", "/opt/trainer/trainer.py", *ARGS]
        with pod_launcher(store / "k8s", store) as (pods, pod_spec):
            cases = {
                "process site": (process, [sys.executable, str(TRAINER), *ARGS]),
                "container site (podman: run attached, rm)": (container, in_image),
                "container site, before (run -d, wait, inspect, logs, rm)": (DetachedBefore(container), in_image),
                "pod site (kube-apiserver + LOCAL NODE AGENT)": (
                    pods,
                    [sys.executable, "/opt/trainer/trainer.py", *ARGS],
                ),
            }
            # The engine's own floor, with the launcher's security options: what no launcher can cut.
            floors = {
                "floor: `python -c pass` as a process": [sys.executable, "-c", "pass"],
                "floor: `podman run --rm` of the image, `python -c pass`": [
                    "podman", "run", "--rm", "--pull=never", "--network=none", "--read-only", "--cap-drop=all",
                    "--security-opt=no-new-privileges", "--user=1000:1000", image, "python", "-c", "pass",
                ],
            }  # fmt: skip
            times: dict[str, list[float]] = {name: [] for name in [*cases, *floors]}
            digests: dict[str, set[str]] = {name: set() for name in cases}
            for rep in range(reps):
                for index, name in rotate(list(enumerate([*cases, *floors])), rep):
                    if name in floors:
                        seconds = _floor(floors[name])
                    else:
                        launcher, argv = cases[name]
                        seconds, digest = _timed(launcher, _job(store, f"case{index}", rep, argv))
                        digests[name].add(digest)
                    times[name].append(seconds)
                    log(f"[containers] {name} rep {rep + 1}: {seconds:.2f} s")
        base = median(times["process site"])
        table = Table(
            "One site job of the digits trainer (1 round, 10 local epochs): launch to accepted end",
            ["site", "engine calls", "median s", "spread s", "x process"],
        )
        calls = {"container site (podman": "2", "container site, before": "5"}
        for name, values in times.items():
            engine_calls = next((n for prefix, n in calls.items() if name.startswith(prefix)), "-")
            table.add(name, engine_calls, f"{median(values):.2f}", spread(values), f"{median(values) / base:.2f}")
        same = len(set().union(*digests.values())) == 1
        process_floor, engine_run = (median(times[name]) for name in floors)
        engine_floor = engine_run - process_floor
        table.notes.append(
            f"Bound: a container site job costs at least the process site's plus the engine's own start and "
            f"removal beyond a process's ({engine_floor:.2f} s, the floor rows), i.e. "
            f"{(base + engine_floor) / base:.2f}x process on this machine whatever the launcher does."
        )
        table.notes.append(
            f"{reps} repetitions per case, alternating. The update is {'bitwise the same' if same else 'NOT the same'} "
            f"from every case (sha256). Goal: container <= 1.5x process. Image {image}; the worker's "
            f"OPENBLAS_* settings ({', '.join(k for k in os.environ if k.startswith('OPENBLAS_')) or 'none'}) "
            "are passed into the container. The pod site's node is the LOCAL NODE AGENT test harness (the "
            "trainer runs as a local process, no image): its row is the Kubernetes API's share of a site job; "
            f"poll_interval {pod_spec.poll_interval:g} s (the site default)."
        )
        return [table]
    finally:
        if not keep:
            shutil.rmtree(store, ignore_errors=True)
