"""One round of N sites x S bytes: flare-airflow's store + aggregation beside NVIDIA FLARE's POC (issue 40 item 4).

    python benchmarks/bench_large_round.py --sites 3 --size-mib 256          # both, side by side
    python benchmarks/bench_large_round.py --sites 6 --size-mib 3195 --skip-nvflare   # the issue's case, not in CI

* **ours** -- the round's exchange and fan-in through a ``file://`` model store: each site's update
  (float32, S bytes, in 64 MiB tensors) written to its slot as the site runner does
  (``write_artifact``), then ``fedavg_from_store`` in a process of its own, its peak memory the
  kernel's high-water mark (VmHWM of that process: interpreter and numpy included). Round time: the
  writes plus the aggregation. The sites' writes run one after another in this process (one disk).
* **NVFlare** -- ``nvflare poc prepare/start`` with N clients (untimed), a ``NumpyFedAvgRecipe`` job
  of one round whose model is S bytes of float32 (``nvflare_jobs/job.py large``; its clients add 1
  and send the model back), submitted through the admin API (``poc_submit.py``). Peak server memory:
  the largest sum of RSS over the server's processes (the parent and its job process), sampled every
  0.2 s (a sampled peak: a lower bound). Round time: submit to FINISHED (includes NVFlare's job
  deployment and start-up, which ours has no equivalent of here: say so when comparing).

NVFlare 2.9.0 comes from the side environment the other NVFlare benchmarks use
(flare_airflow_testing/side_venvs.py). A failure on NVFlare's side is reported in the table, never hidden.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from bench_common import BenchmarkFailed, Table, log

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))
from flare_airflow.core.model import FLModel, write_artifact  # noqa: E402
from flare_airflow_testing.nvflare_poc import Poc, PocError, pids_mentioning  # noqa: E402
from flare_airflow_testing.side_venvs import nvflare_venv  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
TENSOR = 64 * MIB

AGGREGATE = """
import json, sys, time
from pathlib import Path
from flare_airflow.core.aggregation.streaming import fedavg_from_store
from flare_airflow.core.model import read_artifact

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

root, n = Path(sys.argv[1]), int(sys.argv[2])
started = time.monotonic()
glob, _ = read_artifact(root / "global.safetensors")
outcome = fedavg_from_store(glob, [(f"site-{i}", root / f"site-{i}.safetensors", None) for i in range(1, n + 1)],
                            min_clients=n)
print(json.dumps({"seconds": time.monotonic() - started, "peak": status("VmHWM:"),
                  "accepted": len(outcome.accepted), "first": float(outcome.params["t0"][0])}))
"""


def tensors(size: int, value: float) -> dict[str, np.ndarray]:
    out, left, k = {}, size, 0
    while left > 0:
        n = min(TENSOR, left) // 4
        out[f"t{k}"] = np.full(n, value, np.float32)
        left -= n * 4
        k += 1
    return out


def run_ours(root: Path, sites: int, size: int) -> dict[str, float]:
    store = root / "store"
    store.mkdir()
    write_artifact(store / "global.safetensors", FLModel(params=tensors(size, 0.0)))
    started = time.monotonic()
    for i in range(1, sites + 1):
        update = FLModel(params=tensors(size, float(i)), meta={"num_samples": 1})
        write_artifact(store / f"site-{i}.safetensors", update)
        del update
    written = time.monotonic() - started
    proc = subprocess.run(
        [sys.executable, "-c", AGGREGATE, str(store), str(sites)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise BenchmarkFailed(f"ours: the aggregation exited {proc.returncode}: {proc.stderr[-1500:]}")
    got = json.loads(proc.stdout.splitlines()[-1])
    expected = (sites + 1) / 2  # the mean of 1..N
    if got["accepted"] != sites or abs(got["first"] - expected) > 1e-6:
        raise BenchmarkFailed(f"ours: accepted {got['accepted']}/{sites}, mean {got['first']} != {expected}")
    shutil.rmtree(store)
    return {"round": written + got["seconds"], "writes": written, "aggregate": got["seconds"], "peak": got["peak"]}


def rss_of(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as fh:
                total += next((int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:")), 0)
        except OSError:
            continue
    return total


def run_nvflare(root: Path, sites: int, size: int, timeout: float) -> dict[str, object]:
    side, versions = nvflare_venv(log=log)
    export = root / "jobs"
    proc = subprocess.run(
        [str(side.python), str(BENCH_DIR / "nvflare_jobs" / "job.py"), "large", "--sites", str(sites),
         "--rounds", "1", "--workspace", str(root / "sim"), "--size", str(size), "--export-dir", str(export)],
        env=side.env(), capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        return {"error": f"exporting the job failed ({proc.returncode}): {proc.stderr.strip()[-300:]}"}
    job = json.loads(proc.stdout.splitlines()[-1].removeprefix("RESULT "))["job_folder"]
    poc = Poc(side, root / "nvflare", n=sites)
    try:
        poc.prepare()
        poc.start()
        server = str(poc.prod / "server")
        peak, stop = [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss_of(pids_mentioning(server)))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        argv = [
            str(side.python), str(BENCH_DIR / "nvflare_jobs" / "poc_submit.py"), "--startup-kit", str(poc.admin_kit),
            "--job", job, "--download", str(root / "download"), "--timeout", str(timeout),
        ]  # fmt: skip
        run = subprocess.run(argv, env=poc.env, capture_output=True, text=True, timeout=timeout + 300, check=False)
        stop.set()
        sampler.join()
        result = json.loads(next((x[7:] for x in reversed(run.stdout.splitlines()) if x.startswith("RESULT ")), "{}"))
        if run.returncode != 0:
            log(f"NVFlare poc_submit.py:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
            reason = result.get("status") or (run.stderr.strip().splitlines() or ["no output"])[-1][:200]
            return {"error": f"{reason} (poc_submit.py exit {run.returncode})", "peak": peak[0]}
        return {"round": result["finished"] - result["submitted"], "peak": peak[0], "nvflare": versions["nvflare"]}
    except (PocError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
    finally:
        left = poc.stop()
        if left:
            log(f"NVFlare POC: killed leftover processes {left}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--size-mib", type=int, default=256, help="bytes of each update (and of the global model)")
    p.add_argument("--skip-nvflare", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0, help="NVFlare's job, seconds")
    p.add_argument("--tmp", default=None, help="where the stores and the POC workspace go (default: a temp dir)")
    args = p.parse_args(argv)
    size = args.size_mib * MIB
    root = Path(tempfile.mkdtemp(prefix="bench-large-", dir=args.tmp))
    try:
        log(f"ours: {args.sites} x {args.size_mib} MiB")
        ours = run_ours(root, args.sites, size)
        skipped = {"error": "skipped (--skip-nvflare)"}
        theirs = skipped if args.skip_nvflare else run_nvflare(root, args.sites, size, args.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = Table(
        f"One round, {args.sites} sites x {args.size_mib} MiB updates",
        ["system", "round (s)", "peak server memory (GiB)", "peak / one update", "notes"],
    )
    table.add(
        "flare-airflow (file:// store, fedavg_from_store)", f"{ours['round']:.1f}", f"{ours['peak'] / GIB:.2f}",
        f"{ours['peak'] / size:.1f}", f"site writes {ours['writes']:.1f} s, aggregation {ours['aggregate']:.1f} s",
    )  # fmt: skip
    if "error" in theirs:
        peak = theirs.get("peak")
        table.add(
            "NVFlare POC", "failed", f"{int(peak) / GIB:.2f}" if peak else "-", "-", str(theirs["error"])
        )  # fmt: skip
    else:
        table.add(
            f"NVFlare {theirs['nvflare']} POC", f"{theirs['round']:.1f}", f"{int(theirs['peak']) / GIB:.2f}",
            f"{int(theirs['peak']) / size:.1f}", "submit to FINISHED (includes job deployment); sampled RSS peak",
        )  # fmt: skip
    print(table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
