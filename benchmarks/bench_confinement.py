"""What confining a process trainer costs: one site job, confined (bubblewrap) vs unconfined, side by side.

Each case runs the real site runner (``python -m flare_airflow.site_task``, as a site task does)
for one site and one round on a fresh store: the input check, the launch, the trainer, the update
check and publication. Cases alternate (order rotated each repetition); medians with min-max.
Trainers: ``noop_trainer.py`` (receive, send back: the orchestration alone) and the digits demo's
trainer (``dags/digits.yaml``'s settings, one site). The site job is a round's critical path for
that site, so the difference is the per-round cost of confinement.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, cast

from bench_common import BenchmarkFailed, Table, log, median, rotate, spread
from safetensors.numpy import load_file

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.launchers.process.sandbox import Confinement, Sandbox, find_bwrap
from flare_airflow.launchers.process.seccomp import filter_fd
from flare_airflow.site_task.spec import SPEC_ENV, SiteRun

REPO = pathlib.Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
TRAINERS = {
    "no-op": ([str(REPO / "benchmarks" / "noop_trainer.py")], {}),
    "digits (1 site, 10 local epochs)": (
        [str(DIGITS / "trainer.py"), "--num-sites", "4", "--alpha", "0.5", "--seed", "0"],
        {"lr": 0.5, "local_epochs": 10, "batch_size": 16},
    ),
}
MODES = ("off", "auto")


def _site_job(base: pathlib.Path, argv: list[str], hparams: dict, mode: str, n: int) -> float:
    store = base / f"store-{n}"
    global_model = store / "round-0000" / "global.safetensors"
    params = dict(load_file(str(DIGITS / "initial_model.safetensors")))
    write_artifact(cast(Any, global_model), FLModel(params=params))
    run = SiteRun(
        job="bench", run_id="r", round=1, total_rounds=1, site="site-1", task="train",
        argv=[sys.executable, *argv], global_model=str(global_model),
        output=str(store / "round-0001" / "sites" / "site-1.safetensors"),
        staging=str(store / "round-0001" / "staging" / "site-1" / "try-1" / "update.safetensors"),
        hparams=hparams, confinement={"mode": mode},
    )  # fmt: skip
    env = {**os.environ, SPEC_ENV: run.to_json()}
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "flare_airflow.site_task"], env=env, capture_output=True, text=True, check=False
    )
    elapsed = time.perf_counter() - started
    if out.returncode != 0:
        raise BenchmarkFailed(f"site job ({mode}) failed: {out.stderr[-2000:]}")
    if mode == "auto" and "trainer confined (bubblewrap)" not in out.stdout:
        raise BenchmarkFailed(f"the confined case ran unconfined: {out.stdout[-2000:]}")
    return elapsed


def _bare_exec(mode: str) -> float:
    """One exec of ``/bin/true``, plain or under the exact bwrap argv a site job gets."""
    argv = ["/bin/true"]
    fds: tuple[int, ...] = ()
    if mode == "auto":
        sandbox = Sandbox(bwrap=find_bwrap(), confinement=Confinement(), writable=(tempfile.gettempdir(),))
        fds = (filter_fd(),)
        argv = sandbox.argv(argv, None, {}, seccomp_fd=fds[0])
    try:
        started = time.perf_counter()
        subprocess.run(argv, check=True, pass_fds=fds)
        return time.perf_counter() - started
    finally:
        for fd in fds:
            os.close(fd)


def _compare(times: dict[str, list[float]], fmt: str, diff: str) -> list[str]:
    off, on = median(times["off"]), median(times["auto"])
    cells = [f"{fmt.format(median(times[m]))} ({spread(times[m], fmt)})" for m in MODES]
    return [*cells, diff.format((on - off) * 1000), f"{on / off:.2f}"]


def run(reps: int = 5, keep: bool = False, tmp_base: str | None = None) -> list[Table]:
    table = Table(
        "One site job through the site runner: unconfined vs confined (bubblewrap)",
        ["trainer", "unconfined s (median, min-max)", "confined s", "confined - unconfined (ms)", "ratio"],
    )
    with tempfile.TemporaryDirectory(dir=tmp_base, prefix="flare-bench-confine-") as tmp:
        base = pathlib.Path(tmp)
        n = 0
        for name, (argv, hparams) in TRAINERS.items():
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for rep in range(reps):
                for mode in rotate(MODES, rep):
                    n += 1
                    times[mode].append(_site_job(base, argv, hparams, mode, n))
                log(f"[confinement] {name} rep {rep + 1}/{reps}")
            table.add(name, *_compare(times, "{:.3f}", "{:+.0f}"))
        bare: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(reps * 4):
            for mode in rotate(MODES, rep):
                bare[mode].append(_bare_exec(mode))
        table.add("`/bin/true` alone (what bwrap's setup costs)", *_compare(bare, "{:.4f}", "{:+.1f}"))
    table.notes.append(
        "The digits updates are bitwise identical confined or not "
        "(tests/unit/site_task/test_confinement.py); sites of a round run in parallel, so the difference is "
        "also the per-round cost."
    )
    return [table]
