"""Robust aggregation and server optimizers: time and peak memory, side by side with Flower.

    python benchmarks/bench_strategies.py [--cells 16x16,16x64,256x16] [--out results/strategies.md]

For each cell (update size in MiB x number of sites) the updates (4 float32 tensors each, realistic
weights: ``base ~ N(0, 0.05)``, update i = ``base + N(0, 0.01)``) are written once into a temporary
store with ``write_artifact``. Every case then runs in a fresh subprocess, so its peak memory is its
own (VmHWM above the RSS after imports and the global model):

* **ours**: ``aggregate_from_store`` with median, trimmed mean (beta = 0.25) or Krum (f = 1): the
  store engine -- every update verified (digest, NaN/inf, names/shapes/dtypes), then combined an
  8 MiB float64 chunk at a time;
* **Flower**: flwr 1.42's own ``aggregate_median``, ``aggregate_trimmed_avg`` and
  ``aggregate_krum`` (``flwr.server.strategy.aggregate``) in Flower's own virtual environment
  (``/var/tmp/flare-airflow-bench/flwr-venv``, ``pip install flwr==1.42.0 safetensors``), on the
  same arrays loaded with ``safetensors.numpy.load_file`` (no verification): the load and the
  aggregation are timed apart. Flower needs every update in memory; a Flower case whose estimated
  peak exceeds the machine's available memory minus 4 GiB runs once with its address space capped
  (``FLOWER_CAP_MIB``, RLIMIT_AS) and a wall-time limit (``FLOWER_CAPPED_WALL_S``), and the table
  reports where it failed or stopped and its peak until then.

beta = 0.25 makes beta x n an integer at 16 and 64 sites, where Flower's ``int(beta n)`` and our
``ceil(beta n)`` cut the same number. The results are compared (largest absolute difference).

Server optimizers: a FedAvg round's aggregation (``aggregate_from_store`` + writing the global
model, as the task does) against FedAvgM, FedAdam, FedYogi and FedAdagrad (the same, plus reading
the previous round's state, the optimizer step, and writing the new state) at the ``--optimizers``
cell (default: the largest cell), with the time of each stage; and the floor of that overhead: the
state alone read (verified) and written back (``io:fedavgm``: one moment, ``io:fedadam``: two), no
arithmetic. Interleaved, FedAvg then each
optimizer, twice; each ratio is to the FedAvg run just before it (the better of the two rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
FLWR_VENV = Path(os.environ.get("FLARE_BENCH_FLWR_VENV", "/var/tmp/flare-airflow-bench/flwr-venv"))
MIB = 1 << 20
TENSORS = 4
BETA = 0.25
RULES = ("median", "trimmed_mean", "krum")
OPTIMIZERS = {"fedavgm": ("momentum",), "fedadam": ("m", "v"), "fedyogi": ("m", "v"), "fedadagrad": ("m", "v")}
# Flower's peak, in multiples of all updates' bytes: the list of arrays, np.asarray's stack per layer,
# the partition's copy (median, trimmed mean); Krum's flattened copy and one (n, model) delta per site.
FLOWER_FACTOR = {"median": 2.2, "trimmed_mean": 2.2, "krum": 3.2}
# A Flower case that cannot fit runs with its address space capped here (the machine is shared).
FLOWER_CAP_MIB = 8192
# ... and a wall-time limit: at 256 MiB x 64 Flower's loads sat at the cap (7.96 GB RSS, 4-8 % CPU)
# for over 8 min without failing or finishing; such a case is stopped and reported as not finished.
FLOWER_CAPPED_WALL_S = 300.0


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_hwm() -> int:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status_kib("VmRSS")


def _shapes(size_mib: int) -> dict[str, tuple[int, int]]:
    rows = size_mib * MIB // TENSORS // 4 // 1024
    return {f"layer{i}.weight": (rows, 1024) for i in range(TENSORS)}


def write_cell(folder: Path, size_mib: int, sites: int) -> None:
    import numpy as np

    from flare_airflow.core.model import FLModel, write_artifact

    base = {k: np.random.default_rng(0).normal(0, 0.05, s).astype(np.float32) for k, s in _shapes(size_mib).items()}
    write_artifact(folder / "global.safetensors", FLModel(params=base))
    for i in range(sites):
        rng = np.random.default_rng(1000 + i)
        upd = {k: v + rng.normal(0, 0.01, v.shape).astype(np.float32) for k, v in base.items()}
        write_artifact(folder / f"site-{i:03d}.safetensors", FLModel(params=upd, meta={"num_samples": 10 + i}))


# --- workers (one process per case) --------------------------------------------------------------
def read_state(path: Path) -> dict[str, Any]:
    """The previous round's state as the aggregation task reads it: record pinned, file verified by BLAKE3."""
    from flare_airflow.core.model import read_record, read_verified

    return read_verified(path, read_record(path), algorithms=("blake3",))


def worker_state_io(folder: Path, rule: str) -> dict[str, Any]:
    """The floor of a server optimizer's overhead: its state read (verified) and written again
    (hashed, fsync'd), as the task does, with no arithmetic at all."""
    from flare_airflow.core.model import FLModel, write_artifact

    base = _reset_hwm()
    start = time.perf_counter()
    state = read_state(folder / f"state-{rule}.safetensors")
    read = time.perf_counter()
    write_artifact(folder / f"state-{rule}-io.safetensors", FLModel(params=state))
    done = time.perf_counter()
    return {"seconds": done - start, "peak_mib": (_status_kib("VmHWM") - base) / 1024, "read_state": read - start,
            "aggregate": 0.0, "write_state": done - read, "write_global": 0.0}  # fmt: skip


def worker_ours(folder: Path, rule: str, sites: int) -> dict[str, Any]:
    from flare_airflow.core.aggregation.engine import aggregate_from_store
    from flare_airflow.core.aggregation.strategies import StepContext
    from flare_airflow.core.config.aggregator import aggregator_spec
    from flare_airflow.core.model import FLModel, read_artifact, write_artifact

    if rule.startswith("io:"):
        return worker_state_io(folder, rule.removeprefix("io:"))
    spec = {"median": {"name": "median"}, "trimmed_mean": {"name": "trimmed_mean", "beta": BETA}}.get(
        rule, {"name": "krum", "f": 1} if rule == "krum" else {"name": rule}
    )
    strategy = aggregator_spec(spec).strategy()
    glob, _ = read_artifact(folder / "global.safetensors")
    updates = [(f"site-{i:03d}", folder / f"site-{i:03d}.safetensors", None) for i in range(sites)]
    base = _reset_hwm()
    start = time.perf_counter()
    state: dict = {}
    if strategy.stateful and (folder / f"state-{rule}.safetensors").exists():
        state = read_state(folder / f"state-{rule}.safetensors")
    read = time.perf_counter()
    outcome, new_state = aggregate_from_store(
        strategy, glob, updates, min_clients=sites, state=state, context=StepContext("bench", "r", 2),
        consume_state=True,  # as the aggregation task does: the state it just read
    )  # fmt: skip
    aggregated = time.perf_counter()
    if strategy.stateful:
        write_artifact(folder / f"state-{rule}-out.safetensors", FLModel(params=new_state))
    state_written = time.perf_counter()
    if rule in RULES:
        seconds = time.perf_counter() - start
        write_artifact(folder / f"out-ours-{rule}.safetensors", FLModel(params=outcome.params))
    else:  # a round's aggregation writes the global model
        write_artifact(folder / f"out-ours-{rule}.safetensors", FLModel(params=outcome.params))
        seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "peak_mib": (_status_kib("VmHWM") - base) / 1024,
        "read_state": read - start,
        "aggregate": aggregated - read,
        "write_state": state_written - aggregated,
        "write_global": start + seconds - state_written,
    }


def worker_flower(folder: Path, rule: str, sites: int) -> dict[str, Any]:
    import numpy as np
    from flwr.server.strategy.aggregate import aggregate_krum, aggregate_median, aggregate_trimmed_avg
    from safetensors.numpy import load_file, save_file

    names = sorted(load_file(str(folder / "global.safetensors")))
    base = _reset_hwm()
    start = time.perf_counter()
    results = []
    for i in range(sites):
        try:
            params = load_file(str(folder / f"site-{i:03d}.safetensors"))
        except MemoryError:  # under the benchmark's memory cap: Flower cannot hold every update
            peak = (_status_kib("VmHWM") - base) / 1024
            return {"failed": f"out of memory after loading {i} of {sites} updates", "peak_mib": peak}
        results.append(([params[k] for k in names], 10 + i))
        print(json.dumps({"loaded": i + 1, "peak_mib": (_status_kib("VmHWM") - base) / 1024}), flush=True)
    loaded = time.perf_counter()
    if rule == "median":
        out = aggregate_median(results)
    elif rule == "trimmed_mean":
        out = aggregate_trimmed_avg(results, BETA)
    else:
        out = aggregate_krum(results, num_malicious=1, to_keep=0)
    done = time.perf_counter()
    peak = (_status_kib("VmHWM") - base) / 1024
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in zip(names, out, strict=True)},
              str(folder / f"out-flower-{rule}.safetensors"))  # fmt: skip
    return {"load_seconds": loaded - start, "seconds": done - loaded, "peak_mib": peak}


def run_worker(
    python: str, impl: str, folder: Path, rule: str, sites: int, cap_mib: float | None = None
) -> dict[str, Any]:
    """One case in a fresh process; ``cap_mib``: its address space is capped (RLIMIT_AS), so that a
    case that cannot fit fails by itself instead of pushing the shared machine into its OOM killer."""
    import resource

    argv = [python, str(Path(__file__).resolve()), "worker", impl, str(folder), rule, str(sites)]
    env = {k: v for k, v in os.environ.items() if not (impl == "flower" and k in ("VIRTUAL_ENV", "PYTHONPATH"))}

    def cap() -> None:
        if cap_mib is not None:
            limit = int(cap_mib) << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, check=False, env=env, preexec_fn=cap,
            timeout=FLOWER_CAPPED_WALL_S if cap_mib is not None else None,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed it
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        progress = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {"loaded": 0, "peak_mib": 0.0}
        return {"failed": f"did not finish in {FLOWER_CAPPED_WALL_S:.0f} s; had loaded {progress['loaded']} of "
                          f"{sites} updates", "peak_mib": progress["peak_mib"]}  # fmt: skip
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0:
        if cap_mib is None:
            raise SystemExit(f"{impl} {rule} worker failed:\n{out.stderr[-3000:]}")
        progress = json.loads(lines[-1]) if lines else {"loaded": 0, "peak_mib": 0.0}
        why = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:160]
        return {"failed": f"died after loading {progress['loaded']} of {sites} updates ({why})",
                "peak_mib": progress["peak_mib"]}  # fmt: skip
    return dict(json.loads(lines[-1]))


def max_diff(folder: Path, rule: str) -> str:
    from safetensors.numpy import load_file

    ours, theirs = (load_file(str(folder / f"out-{i}-{rule}.safetensors")) for i in ("ours", "flower"))
    return f"{max(float(abs(ours[k].astype('f8') - theirs[k].astype('f8')).max()) for k in ours):.2e}"


def mem_available_mib() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="16x16,16x64,256x16", help="SIZE_MIBxSITES,...")
    p.add_argument(
        "--optimizers",
        default="",
        help="SIZE_MIBxSITES: the cell of the server optimizers' table (default: the largest of --cells; none: skip)",
    )
    p.add_argument("--out", default=str(BENCH_DIR / "results" / "strategies.md"))
    p.add_argument("--tmp", default="/var/tmp/flare-airflow-bench")
    args = p.parse_args(argv)
    sys.path.insert(0, str(BENCH_DIR))
    from bench_common import Table, log, machine_table

    flwr_python = FLWR_VENV / "bin" / "python"
    if not flwr_python.exists():
        setup = f"python3 -m venv {FLWR_VENV} && {FLWR_VENV}/bin/pip install flwr==1.42.0 safetensors"
        raise SystemExit(f"Flower's venv is missing: {setup}")
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",") if c]
    optim_cell: tuple[int, ...] | None = max(cells) if cells else None
    if args.optimizers:
        optim_cell = None if args.optimizers == "none" else tuple(int(x) for x in args.optimizers.split("x"))
    grid = [(size, sites, True) for size, sites in cells]
    if optim_cell is not None and optim_cell not in cells:
        grid.append((optim_cell[0], optim_cell[1], False))
    Path(args.tmp).mkdir(parents=True, exist_ok=True)
    robust = Table(
        "Robust aggregation: ours (store engine, verified reads) vs Flower 1.42 (arrays in memory)",
        ["cell", "rule", "ours s", "Flower s (aggregate)", "Flower s (load + aggregate)", "ratio ours / Flower total",
         "ours peak MiB", "Flower peak MiB", "max abs diff"],
    )  # fmt: skip
    optim = Table(
        "Server optimizers: overhead on a FedAvg round's aggregation",
        ["cell", "strategy", "seconds (mean of 2)", "vs FedAvg (pooled; each pair)", "read state s",
         "aggregate (+ step) s", "write state s", "write global s", "peak MiB"],
    )  # fmt: skip
    started = time.monotonic()
    machine = machine_table(args.tmp)
    for size, sites, robust_cell in grid:
        with tempfile.TemporaryDirectory(dir=args.tmp, prefix="strategies-") as tmp:
            folder = Path(tmp)
            log(f"[strategies] writing {sites} updates of {size} MiB")
            write_cell(folder, size, sites)
            cell = f"{size} MiB x {sites}"
            capped: dict[str, Any] | None = None
            for rule in RULES if robust_cell else ():
                ours = run_worker(sys.executable, "ours", folder, rule, sites)
                need = FLOWER_FACTOR[rule] * size * sites
                if need > mem_available_mib() - 4096:
                    # Flower cannot fit: run it under a cap it must exceed, and report how far it got.
                    # Its load step (every update in memory) comes before any rule: tried once.
                    cap = min(FLOWER_CAP_MIB, mem_available_mib() - 8192)
                    if capped is None:
                        capped = run_worker(str(flwr_python), "flower", folder, rule, sites, cap_mib=cap)
                        log(f"[strategies] {cell}: Flower under a {cap:.0f} MiB cap: {capped}")
                    failed = capped.get("failed", "ran")
                    robust.add(cell, rule, f"{ours['seconds']:.2f}", f"failed: {failed}", "-", "-",
                               f"{ours['peak_mib']:.0f}",
                               f"{capped['peak_mib']:.0f} at a {cap / 1024:.0f} GiB cap (needs ~{need / 1024:.0f} GiB)",
                               "-")  # fmt: skip
                    log(f"[strategies] {cell} {rule}: ours {ours}; Flower needs ~{need:.0f} MiB")
                    continue
                flower = run_worker(str(flwr_python), "flower", folder, rule, sites)
                total = flower["load_seconds"] + flower["seconds"]
                robust.add(cell, rule, f"{ours['seconds']:.2f}", f"{flower['seconds']:.2f}", f"{total:.2f}",
                           f"{ours['seconds'] / total:.2f}", f"{ours['peak_mib']:.0f}", f"{flower['peak_mib']:.0f}",
                           max_diff(folder, rule))  # fmt: skip
                log(f"[strategies] {cell} {rule}: ours {ours} Flower {flower}")
            if (size, sites) == optim_cell:
                from flare_airflow.core.model import FLModel, read_artifact, write_artifact

                glob, _ = read_artifact(folder / "global.safetensors")
                for rule, slots in OPTIMIZERS.items():
                    # round 2: the previous round's state exists, as in any round after the first
                    state = {f"{rule}/{s}/{k}": abs(v) * 0.01 for s in slots for k, v in glob.items()}
                    write_artifact(folder / f"state-{rule}.safetensors", FLModel(params=state))
                del glob, state
                # Interleaved, twice: a shared machine's load drifts, so each optimizer runs right after
                # a FedAvg run; seconds are the two runs' mean, the ratio is pooled over both pairs.
                # "io:X": X's state read and written again, no arithmetic -- the floor of X's overhead.
                cases = ("fedavg", *OPTIMIZERS, "io:fedavgm", "io:fedadam")
                runs: dict[str, list[tuple[dict[str, Any], float]]] = {rule: [] for rule in cases}
                for _ in range(2):
                    fedavg = run_worker(sys.executable, "ours", folder, "fedavg", sites)
                    runs["fedavg"].append((fedavg, fedavg["seconds"]))
                    for rule in cases[1:]:
                        res = run_worker(sys.executable, "ours", folder, rule, sites)
                        runs[rule].append((res, fedavg["seconds"]))
                        log(f"[strategies] {cell} {rule}: {res} (fedavg {fedavg})")
                for rule, pairs in runs.items():
                    mean = {k: sum(r[k] for r, _ in pairs) / len(pairs) for k in pairs[0][0]}
                    ratio = sum(r["seconds"] for r, _ in pairs) / sum(f for _, f in pairs)
                    each = " / ".join(f"{r['seconds'] / f:.3f}" for r, f in pairs)
                    optim.add(cell, rule, f"{mean['seconds']:.2f}", f"{ratio:.3f} ({each})",
                              *(f"{mean[k]:.2f}" for k in ("read_state", "aggregate", "write_state", "write_global")),
                              f"{max(r['peak_mib'] for r, _ in pairs):.0f}")  # fmt: skip
    text = "\n".join(
        [
            "# Strategies: robust aggregation vs Flower, server optimizers' overhead",
            "",
            f"`python benchmarks/bench_strategies.py --cells {args.cells}"
            f"{' --optimizers ' + args.optimizers if args.optimizers else ''}` -- one run of each case "
            f"({time.monotonic() - started:.0f} s in all); see the module docstring for what is measured.",
            "",
            machine.markdown(),
            *([robust.markdown()] if cells else []),
            *([optim.markdown()] if optim_cell is not None else []),
        ]
    )
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        impl, folder, rule, sites = sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        fn = worker_ours if impl == "ours" else worker_flower
        print(json.dumps(fn(folder, rule, sites)))
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
