"""One site job's cost on a container site next to a process site: the same digits trainer, one round.

Both go through their launcher exactly as a site task does (``ProcessLauncher`` /
``ContainerLauncher``, rootful podman, the project's trainer image built by ``docker/images.py``),
from ``launch_job`` until ``wait`` returned SUCCESS and the container is removed; the cases
alternate within one run. The goal (issue 27): a container site's round within 1.5x a process
site's. The update of each case is checked (the same sha256 from both backends).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import BenchmarkFailed, Table, log, median, rotate, spread

from flare_airflow.core.config import ContainerLaunchSpec
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode, SiteJob
from flare_airflow.launchers.container import ContainerLauncher
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


def _timed(launcher: ContainerLauncher | ProcessLauncher, job: SiteJob) -> tuple[float, str]:
    started = time.monotonic()
    handle = launcher.launch_job(job)
    rc = handle.wait(300)
    elapsed = time.monotonic() - started
    if rc is not JobReturnCode.SUCCESS:
        raise BenchmarkFailed(f"{job.run_id}: {rc.name} {handle.reason}")
    update = Path(job.env["FLARE_OUTPUT"]).read_bytes()
    return elapsed, hashlib.sha256(update).hexdigest()


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
        cases = {
            "process site": (process, [sys.executable, str(TRAINER), *ARGS]),
            "container site (podman)": (container, ["python", "/opt/trainer/trainer.py", *ARGS]),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        digests: dict[str, set[str]] = {name: set() for name in cases}
        for rep in range(reps):
            for name in rotate(list(cases), rep):
                launcher, argv = cases[name]
                seconds, digest = _timed(launcher, _job(store, name.split()[0], rep, argv))
                times[name].append(seconds)
                digests[name].add(digest)
                log(f"[containers] {name} rep {rep + 1}: {seconds:.2f} s")
        base = median(times["process site"])
        table = Table(
            "One site job of the digits trainer (1 round, 10 local epochs): launch to accepted end",
            ["site", "median s", "spread s", "x process"],
        )
        for name, values in times.items():
            table.add(name, f"{median(values):.2f}", spread(values), f"{median(values) / base:.2f}")
        same = len(set().union(*digests.values())) == 1
        table.notes.append(
            f"{reps} repetitions per case, alternating. The update is {'bitwise the same' if same else 'NOT the same'} "
            f"from both backends (sha256). Goal: container <= 1.5x process. Image {image}; the worker's "
            f"OPENBLAS_* settings ({', '.join(k for k in os.environ if k.startswith('OPENBLAS_')) or 'none'}) "
            "are passed into the container."
        )
        return [table]
    finally:
        if not keep:
            shutil.rmtree(store, ignore_errors=True)
