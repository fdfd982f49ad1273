"""The NVFlare Client API stand-in's per-round cost next to flare-airflow's own Client API.

One site job's trainer, in a fresh interpreter each time (as every site job starts one), on the
digits model (``examples/digits/initial_model.safetensors``: weight 64 x 10, bias 10):

* **native**: ``python trainer.py`` -- ``import flare_airflow.client``, ``receive()``, ``send()``;
* **stand-in**: ``python -m flare_airflow.core.nvflare.run trainer.py`` -- the compatibility runner
  (state check of the script, the ``nvflare`` stand-in on the path), then ``import nvflare.client``,
  ``init()``, ``while is_running(): receive(); send()``, as an unmodified NVFlare script does;
* **floor**: ``python -c pass`` (the interpreter's own start-up).

Each trainer prints the time from the first line of its script to after ``send()`` (import +
receive + send, in the process); the benchmark measures each process's wall time. Cases alternate
(order rotated each repetition); medians and spreads reported. No training happens: the update
is the model received, so what is measured is the exchange alone.

    .venv/bin/python benchmarks/run.py --only nvflare-shim --reps 15
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import BenchmarkFailed, Table, log, median, rotate, spread

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "digits" / "initial_model.safetensors"

NATIVE = """\
import time
t0 = time.perf_counter()
import flare_airflow.client as flare

model = flare.receive()
flare.send(flare.FLModel(params=model.params, meta={"num_samples": 1}))
print("INNER", time.perf_counter() - t0)
"""

STAND_IN = """\
import time
t0 = time.perf_counter()
import nvflare.client as flare
from nvflare.apis.fl_constant import FLMetaKey

flare.init()
while flare.is_running():
    model = flare.receive()
    flare.send(flare.FLModel(params=model.params, meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: 1}))
print("INNER", time.perf_counter() - t0)
"""

CASES = ("floor", "native", "stand-in")


def _argv(case: str, root: Path) -> list[str]:
    if case == "floor":
        return [sys.executable, "-c", "pass"]
    if case == "native":
        return [sys.executable, str(root / "native.py")]
    return [sys.executable, "-m", "flare_airflow.core.nvflare.run", str(root / "stand_in.py")]


def _env(root: Path, rep: int, case: str) -> dict[str, str]:
    out = root / "out" / f"{case}-{rep}" / "update.safetensors"
    return {
        **os.environ,
        "FLARE_JOB": "digits",
        "FLARE_RUN_ID": "bench",
        "FLARE_SITE": "site-1",
        "FLARE_ROUND": "1",
        "FLARE_TOTAL_ROUNDS": "5",
        "FLARE_TASK": "train",
        "FLARE_GLOBAL_MODEL": str(root / "global.safetensors"),
        "FLARE_OUTPUT": str(out),
        "FLARE_HPARAMS": "{}",
    }


def run(*, reps: int, tmp_base: str | None = None) -> list[Table]:
    from safetensors.numpy import load_file

    from flare_airflow.core.model import FLModel, read_artifact, write_artifact

    with tempfile.TemporaryDirectory(prefix="bench-nvflare-shim-", dir=tmp_base) as tmp:
        root = Path(tmp)
        params = load_file(str(MODEL))  # a plain safetensors file (no record): the job's initial model
        write_artifact(root / "global.safetensors", FLModel(params=params))
        (root / "native.py").write_text(NATIVE)
        (root / "stand_in.py").write_text(STAND_IN)
        walls: dict[str, list[float]] = {c: [] for c in CASES}
        inner: dict[str, list[float]] = {c: [] for c in CASES if c != "floor"}
        for rep in range(reps):
            for case in rotate(CASES, rep):
                started = time.perf_counter()
                proc = subprocess.run(
                    _argv(case, root), env=_env(root, rep, case), capture_output=True, text=True, check=False
                )
                wall = time.perf_counter() - started
                if proc.returncode != 0:
                    raise BenchmarkFailed(f"{case} trainer failed: {proc.stderr[-2000:]}")
                walls[case].append(wall)
                if case != "floor":
                    inner[case].append(float(proc.stdout.split("INNER", 1)[1].split()[0]))
                    sent, _ = read_artifact(root / "out" / f"{case}-{rep}" / "update.safetensors")
                    if sent.keys() != params.keys():
                        raise BenchmarkFailed(f"{case}: the update is not the digits model")
            log(f"[nvflare-shim] rep {rep + 1}/{reps} done")
    table = Table(
        "NVFlare Client API stand-in vs flare-airflow's Client API: one site job's exchange (digits model)",
        ["case", "process wall, median (ms)", "spread", "import + receive + send in process (ms)", "spread"],
    )
    for case in CASES:
        table.add(
            case,
            f"{median(walls[case]) * 1000:.0f}",
            spread([w * 1000 for w in walls[case]], "{:.0f}"),
            f"{median(inner[case]) * 1000:.1f}" if case in inner else "-",
            spread([w * 1000 for w in inner[case]], "{:.1f}") if case in inner else "-",
        )
    native, stand_in, floor = (median(walls[c]) for c in ("native", "stand-in", "floor"))
    table.notes.append(
        f"Per round the stand-in adds {(stand_in - native) * 1000:.0f} ms of process wall time to the native "
        f"Client API ({stand_in / native:.2f}x the native process; {(stand_in - floor) / (native - floor):.2f}x "
        f"above the interpreter floor); in process, import + receive + send take "
        f"{median(inner['stand-in']) / median(inner['native']):.2f}x the native time. "
        f"{reps} repetitions per case, alternating."
    )
    return [table]


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    for table in run(reps=args.reps):
        print(table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
