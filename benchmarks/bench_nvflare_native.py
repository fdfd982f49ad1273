"""NVFlare-native mode's added latency per job, next to NVFlare's own CLI, on one FLARE deployment.

One NVFlare 2.9 POC system (server + 2 clients, flare_airflow_testing/nvflare_poc.py) runs NVFlare's hello-numpy
export (``NumpyFedAvgRecipe``, 2 rounds) again and again, two ways alternating (order rotated):

* **nvflare CLI** -- what an operator types: ``nvflare job submit -j JOB``, ``nvflare job wait
  JOB_ID``, ``nvflare job download JOB_ID`` (each a process of its own with its own login);
* **native mode** -- what one :class:`FlareJobOperator` task does, in this process: readiness +
  submit with the submit token (one bridge process), the trigger's watch (one bridge process, a
  status line per change), then the download and the publish of the global model into a model
  store as safetensors (one bridge process + our writer).

Both poll every second. The clock runs from the first command to the global model on disk (the
download's ``models/server.npy``, or our published safetensors); each way's final model is checked
(initial + 2 x 2.5). Airflow's own scheduling of the task is not in this number: see
benchmarks/results/nvflare_poc.md for a task's start-up under the real scheduler.

    .venv/bin/python benchmarks/run.py --only nvflare-native --reps 5
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from bench_common import BenchmarkFailed, Table, log, median, rotate, spread

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # flare_airflow_testing (the POC harness, NVFlare's side environment)

HELLO_DIR = REPO / "tests" / "integration" / "nvflare"
POLL = 1.0
CONN = "flare_bench"
WAYS = ("nvflare-cli", "native")
EXPECTED = np.arange(1, 10, dtype=np.float32).reshape(3, 3) + 2 * 2.5


def _cli(poc: Any, *args: str) -> str:
    argv = [poc.nvflare, "job", *args, "--startup-kit", str(poc.admin_kit)]
    proc = subprocess.run(argv, env=poc.env, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise BenchmarkFailed(f"`nvflare job {' '.join(args)}` exited {proc.returncode}: {proc.stdout[-800:]}")
    return proc.stdout + proc.stderr


def run_cli(poc: Any, job: str, out: Path) -> float:
    started = time.perf_counter()
    submitted = _cli(poc, "submit", "-j", job)
    found = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", submitted)
    if found is None:
        raise BenchmarkFailed(f"no job id in `nvflare job submit`'s output: {submitted[-800:]}")
    job_id = found.group(0)
    _cli(poc, "wait", job_id, "--interval", str(POLL))
    _cli(poc, "download", job_id, "-o", str(out))
    elapsed = time.perf_counter() - started
    models = list(out.rglob("models/server.npy"))
    if not models:
        raise BenchmarkFailed(f"nvflare CLI: no models/server.npy under {out}")
    np.testing.assert_array_equal(np.load(models[0]), EXPECTED)
    return elapsed


def run_native(job: str, store: Path, rep: int) -> float:
    from flare_airflow.operators.nvflare_native import FlareJobOperator
    from flare_airflow.triggers.flare_job import FlareJobTrigger

    op = FlareJobOperator(
        task_id="hello",
        job_folder=job,
        flare_conn_id=CONN,
        expected_clients=["site-1", "site-2"],
        store=str(store),
        poll_interval=POLL,
    )
    context: Any = {
        "ti": SimpleNamespace(dag_id="bench_native", task_id="hello", map_index=-1, try_number=1),
        "run_id": f"bench-{rep}-{time.time_ns()}",
        "outlet_events": {asset: SimpleNamespace(extra=None) for asset in op.outlets},
    }
    started = time.perf_counter()
    job_id = str(op.submit_job(context)["job_id"])
    trigger = FlareJobTrigger(job_id=job_id, flare_conn_id=CONN, poll_interval=POLL)

    async def first_event() -> dict[str, Any]:
        return dict((await trigger.run().__anext__()).payload)

    event = asyncio.run(first_event())
    if event["status"] != "success":
        raise BenchmarkFailed(f"native mode: {event['reason']}")
    published = op.publish(context, job_id)
    elapsed = time.perf_counter() - started
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(load_file(published["final_model"].removeprefix("file://"))["numpy_key"], EXPECTED)
    return elapsed


def run(*, reps: int, keep: bool = False, tmp_base: str | None = None) -> list[Table]:
    from flare_airflow_testing.nvflare_poc import Poc
    from flare_airflow_testing.side_venvs import nvflare_venv

    side, versions = nvflare_venv(log=log)
    with tempfile.TemporaryDirectory(prefix="bench-nvflare-native-", dir=tmp_base) as tmp:
        root = Path(tmp)
        made = subprocess.run(
            [
                str(side.python),
                str(HELLO_DIR / "make_native_jobs.py"),
                str(root / "jobs"),
                str(HELLO_DIR / "hello_numpy_client.py"),
            ],
            env=side.env(),
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if made.returncode != 0:
            raise BenchmarkFailed(f"exporting hello-numpy failed: {made.stderr[-1500:]}")
        job = json.loads(made.stdout.strip().splitlines()[-1].removeprefix("RESULT "))["hello-numpy"]
        poc = Poc(side, root, n=2)
        poc.prepare()
        started = time.monotonic()
        poc.start()
        start_s = time.monotonic() - started
        os.environ[f"AIRFLOW_CONN_{CONN.upper()}"] = json.dumps(
            {
                "conn_type": "nvflare",
                "login": "admin@nvidia.com",
                "extra": {"startup_kit": str(poc.admin_kit), "python": str(side.python)},
            }
        )
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        try:
            for rep in range(reps):
                for way in rotate(WAYS, rep):
                    if way == "nvflare-cli":
                        times[way].append(run_cli(poc, job, root / "cli" / str(rep)))
                    else:
                        times[way].append(run_native(job, root / "store", rep))
                log(f"[nvflare-native] rep {rep + 1}/{reps}: " + ", ".join(f"{w} {times[w][-1]:.1f}s" for w in WAYS))
        finally:
            leftovers = poc.stop()
        if leftovers:
            raise BenchmarkFailed(f"`nvflare poc stop` left processes (killed by id): {leftovers}")
    cli, native = median(times["nvflare-cli"]), median(times["native"])
    ratios = [n / c for n, c in zip(times["native"], times["nvflare-cli"], strict=True)]
    table = Table(
        f"One hello-numpy job (2 clients x 2 rounds) on NVFlare {versions['nvflare']}'s POC system: "
        "first command -> global model on disk, seconds",
        ["way", "median", "min-max", "native / CLI (per repetition)"],
    )
    table.add("nvflare CLI: job submit + wait + download", f"{cli:.2f}", spread(times["nvflare-cli"]), "-")
    table.add(
        "native mode: FlareJobOperator submit + trigger + publish",
        f"{native:.2f}",
        spread(times["native"]),
        f"**{median(ratios):.2f}** ({spread(ratios)})",
    )
    table.notes.append(
        f"Added latency of native mode per job: {native - cli:+.2f} s (difference of the medians); "
        f"{reps} repetitions, the two ways alternating, order rotated; both poll every {POLL:.0f} s. "
        f"POC start (untimed): {start_s:.0f} s; no FLARE process left after `nvflare poc stop`. "
        "Each CLI command and each bridge call logs in anew (NVFlare interpreter start + import + TLS login)."
    )
    return [table]


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    for table in run(reps=args.reps):
        print(table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
