"""FedAvg benchmark: throughput and peak memory of ``fedavg_from_store`` on large updates.

For each update size, N updates (4 float32 tensors each) are written once with
:func:`flare_airflow.core.model.write_artifact` into a temporary store on disk, then every case runs
in a fresh subprocess (``python bench_fedavg.py worker JSON``) so that its peak memory is its own:

* ``fedavg``: load the global model, reset the kernel's RSS high-water mark, time
  ``fedavg_from_store`` over the N updates, read the high-water mark again;
* ``ref``: numpy's own streaming bandwidth on the same bytes -- (a) ``readinto`` of the same files
  from the page cache into a preallocated buffer, (b) ``acc += a * np.float64(w)`` in memory;
* ``breakdown``: the stages of one update (read, sha256, safetensors parse, finite check,
  accumulate), timed separately, plus a few measured alternatives.

The ``fedavg`` and ``ref`` workers alternate, order rotated each repetition.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import MIB, BenchmarkFailed, Table, filesystem_of, gbps, log, median, rotate, spread

BENCH_DIR = Path(__file__).resolve().parent
TENSORS = 4
COLUMNS = 1024


def _shapes(size: int) -> dict[str, tuple[int, int]]:
    rows = size // TENSORS // 4 // COLUMNS
    return {f"layer{i}.weight": (rows, COLUMNS) for i in range(TENSORS)}


def _update_path(store: Path, i: int) -> Path:
    return store / "round-0001" / "sites" / f"site-{i:02d}.safetensors"


def _global_path(store: Path) -> Path:
    return store / "round-0000" / "global.safetensors"


def _num_samples(i: int) -> int:
    return 10 + i  # unequal weights, so the weighting is exercised


# --- memory probes (Linux) ----------------------------------------------------------------------------


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_hwm() -> bool:
    """Reset the RSS high-water mark (VmHWM, what ru_maxrss reports) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# --- workers (run in fresh subprocesses) ---------------------------------------------------------------


def _worker_generate(args: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from flare_airflow.core.model import FLModel, write_artifact

    store, size, n = Path(args["store"]), int(args["size"]), int(args["n"])
    rng = np.random.default_rng(0)
    base = {k: rng.standard_normal(shape, dtype=np.float32) for k, shape in _shapes(size).items()}
    started = time.perf_counter()
    write_artifact(_global_path(store), FLModel(params=base))
    for i in range(n):
        params = {k: v + np.float32(i) for k, v in base.items()}
        write_artifact(
            _update_path(store, i), FLModel(params=params, metrics={"loss": 1.0}, meta={"num_samples": _num_samples(i)})
        )
        del params
    return {"seconds": time.perf_counter() - started}


def _worker_fedavg(args: dict[str, Any]) -> dict[str, Any]:
    import gc

    import numpy as np

    from flare_airflow.core.aggregation import fedavg_from_store
    from flare_airflow.core.model import read_artifact

    store, n = Path(args["store"]), int(args["n"])
    global_params, _ = read_artifact(_global_path(store))
    updates = [(f"site-{i:02d}", _update_path(store, i), None) for i in range(n)]
    nbytes = sum(p.stat().st_size for _, p, _ in updates)
    gc.collect()
    use_tracemalloc = bool(args.get("tracemalloc"))
    if use_tracemalloc:
        import tracemalloc

        tracemalloc.start()
    reset = _reset_hwm()
    base_rss = _status_kib("VmRSS") if reset else _status_kib("VmHWM")
    started = time.perf_counter()
    outcome = fedavg_from_store(global_params, updates, min_clients=n)
    seconds = time.perf_counter() - started
    peak_kib = _status_kib("VmHWM")
    traced_peak = tracemalloc.get_traced_memory()[1] if use_tracemalloc else None
    if use_tracemalloc:
        tracemalloc.stop()
    if len(outcome.accepted) != n or outcome.rejected:
        raise BenchmarkFailed(f"expected {n} accepted updates, got {sorted(outcome.accepted)}; {outcome.rejected}")
    # Update i is global + i with weight 10 + i: the average is global + sum(w_i * i) / sum(w_i).
    shift = sum(_num_samples(i) * i for i in range(n)) / sum(_num_samples(i) for i in range(n))
    name = next(iter(global_params))
    want = global_params[name][:4, :8].astype(np.float64) + shift
    if not np.allclose(outcome.params[name][:4, :8], want, rtol=1e-5, atol=1e-4):
        raise BenchmarkFailed(f"FedAvg result is wrong: {outcome.params[name][0, :4]} vs {want[0, :4]}")
    return {
        "seconds": seconds,
        "bytes": nbytes,
        "peak_delta": (peak_kib - base_rss) * 1024,
        "hwm_reset": reset,
        "traced_peak": traced_peak,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _worker_ref(args: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from flare_airflow.core.model import read_artifact

    store, n = Path(args["store"]), int(args["n"])
    files = [_update_path(store, i) for i in range(n)]
    sizes = [p.stat().st_size for p in files]
    buf = np.ones(max(sizes), dtype=np.uint8)  # preallocated and touched
    view = memoryview(buf)
    started = time.perf_counter()
    for path, size in zip(files, sizes, strict=True):
        with open(path, "rb", buffering=0) as fh:
            got = 0
            while got < size:
                k = fh.readinto(view[got:size])
                if not k:
                    break
                got += k
        if got != size:
            raise BenchmarkFailed(f"readinto read {got} of {size} bytes from {path}")
    read_s = time.perf_counter() - started

    a, _ = read_artifact(_global_path(store))  # the same tensors (shapes, dtype, values) as the updates
    acc = {k: np.zeros(v.shape, dtype=np.float64) for k, v in a.items()}
    for v in acc.values():
        v += 1.0  # touch the accumulator's pages, as FedAvg's is after its first update
    tensor_bytes = sum(v.nbytes for v in a.values())
    started = time.perf_counter()
    for i in range(n):
        w = np.float64(_num_samples(i))
        for k, arr in a.items():
            acc[k] += arr * w
    madd_s = time.perf_counter() - started
    return {"read_seconds": read_s, "read_bytes": sum(sizes), "madd_seconds": madd_s, "madd_bytes": n * tensor_bytes}


def _zero_copy_parse(data: bytes) -> dict[str, Any]:
    """safetensors parsed as views into ``data`` (no copy): header length, JSON header, offsets."""
    import numpy as np

    hlen = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + hlen])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = {"F32": np.float32, "F64": np.float64, "F16": np.float16}[info["dtype"]]
        out[name] = np.frombuffer(
            data, dtype=dtype, count=(end - start) // np.dtype(dtype).itemsize, offset=8 + hlen + start
        ).reshape(info["shape"])
    return out


def _worker_breakdown(args: dict[str, Any]) -> dict[str, Any]:
    import hashlib

    import numpy as np

    from flare_airflow.core.aggregation import FedAvg
    from flare_airflow.core.model import all_finite, parse_safetensors, read_artifact

    store, reps = Path(args["store"]), int(args["reps"])
    path = _update_path(store, 0)
    global_params, _ = read_artifact(_global_path(store))
    acc = {k: np.zeros(v.shape, dtype=np.float64) for k, v in global_params.items()}
    for v in acc.values():
        v += 1.0
    w = np.float64(_num_samples(0))
    times: dict[str, list[float]] = {}

    def timed(key: str, started: float) -> float:
        now = time.perf_counter()
        times.setdefault(key, []).append(now - started)
        return now

    osp = None
    if args.get("object_storage_path"):
        from airflow.sdk import ObjectStoragePath  # what the Airflow aggregation task's store paths are

        osp = ObjectStoragePath("file://" + str(path))
        with osp.open("rb") as fh:  # first use initialises the filesystem; not timed
            fh.read(16)
    chunk = 1 << 17
    scratch = np.empty(chunk, dtype=np.float64)
    reuse = np.ones(path.stat().st_size, dtype=np.uint8)
    agg = FedAvg(global_params, min_clients=1)
    for v in agg._acc.values():  # touched, as the accumulator is after the first update
        v += 0.0
    # Iteration 0 is a warm-up (first-touch page faults, the allocator's thresholds settling), as the
    # first update of a round is; the reported medians are of the steady state, one update after another.
    for it in range(reps + 1):
        if it == 1:
            times.clear()
        path = _update_path(store, it % 4)
        # The stages of read_artifact + FedAvg.add, in the package's order, with the same calls.
        t = time.perf_counter()
        with path.open("rb") as fh:
            data = fh.read()
        t = timed("read", t)
        hashlib.sha256(data).hexdigest()
        t = timed("sha256", t)
        params = parse_safetensors(data, str(path))
        t = timed("parse", t)
        del data
        t = time.perf_counter()
        all_finite(params)
        t = timed("finite", t)
        for name, arr in params.items():
            acc[name] += arr * w
        timed("accumulate", t)
        del params

        # The same, measured as the package runs it (next update file).
        path = _update_path(store, (it + 1) % 4)
        t = time.perf_counter()
        params, record = read_artifact(path)
        agg.add(f"site-{it}", params, record)
        timed("together", t)
        if f"site-{it}" not in agg.accepted:
            raise BenchmarkFailed(f"the update was rejected: {agg.rejected}")
        del params

        # Alternatives, for whoever optimises (not what the package does today).
        path = _update_path(store, (it + 2) % 4)
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as raw:
            raw.readinto(memoryview(reuse))
        t = timed("alt_readinto", t)
        with path.open("rb") as fh:
            data = fh.read()
        t = time.perf_counter()
        views = _zero_copy_parse(data)
        t = timed("alt_parse", t)
        for name, arr in views.items():
            flat, out = arr.reshape(-1), acc[name].reshape(-1)
            for s in range(0, flat.size, chunk):
                m = min(chunk, flat.size - s)
                np.multiply(flat[s : s + m], w, out=scratch[:m])
                if not np.isfinite(scratch[:m]).all():
                    raise BenchmarkFailed("non-finite value")
                out[s : s + m] += scratch[:m]
        timed("alt_fused", t)
        del views, data
        if osp is not None:
            t = time.perf_counter()
            with osp.open("rb") as fh:
                data = fh.read()
            timed("alt_osp_read", t)
            del data
    return {"times": times, "bytes": path.stat().st_size}


WORKERS = {
    "generate": _worker_generate,
    "fedavg": _worker_fedavg,
    "ref": _worker_ref,
    "breakdown": _worker_breakdown,
}


def _call(kind: str, env: dict[str, str] | None = None, **args: Any) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "worker", kind, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise BenchmarkFailed(f"{kind} worker {args} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


# --- the benchmark ---------------------------------------------------------------------------------------


def run(
    *, sizes_mib: list[int], counts: list[int], reps: int, quick: bool, keep: bool, tmp_base: str | None
) -> list[Table]:
    base = Path(tempfile.mkdtemp(prefix="flare-bench-fedavg-", dir=tmp_base))
    mount, fstype = filesystem_of(str(base))
    if fstype in ("tmpfs", "ramfs") or str(base).startswith("/dev/shm"):
        shutil.rmtree(base, ignore_errors=True)
        raise BenchmarkFailed(f"{base} is on {fstype} ({mount}); the store must be on disk: pass --tmp-dir")
    rows: list[dict[str, Any]] = []
    breakdown: dict[str, Any] | None = None
    try:
        for size_mib in sizes_mib:
            size = size_mib * MIB
            n_max = max(counts)
            need = (n_max + 1) * size * 1.05 + (1 << 30)
            free = shutil.disk_usage(base).free
            if free < need:
                raise BenchmarkFailed(f"{base}: {free / (1 << 30):.1f} GiB free, need {need / (1 << 30):.1f} GiB")
            store = base / f"{size_mib}MiB"
            gen = _call("generate", store=str(store), size=size, n=n_max)
            log(f"[fedavg] wrote {n_max} x {size_mib} MiB updates in {gen['seconds']:.1f}s ({store})")
            _call("ref", store=str(store), n=n_max)  # untimed warm-up: settle the page cache and memory
            results: dict[tuple[int, str], list[dict[str, Any]]] = {}
            cases = [(n, kind) for n in counts for kind in ("fedavg", "ref")]
            for rep in range(reps):
                for n, kind in rotate(cases, rep):
                    results.setdefault((n, kind), []).append(_call(kind, store=str(store), n=n))
                line = ", ".join(
                    f"N={n} {gbps(results[(n, 'fedavg')][-1]['bytes'], results[(n, 'fedavg')][-1]['seconds']):.2f} GB/s"
                    for n in counts
                )
                log(f"[fedavg] {size_mib} MiB rep {rep + 1}/{reps}: {line}")
            traced = {n: _call("fedavg", store=str(store), n=n, tracemalloc=True) for n in counts}
            for n in counts:
                rows.append(
                    {
                        "size_mib": size_mib,
                        "n": n,
                        "ours": results[(n, "fedavg")],
                        "ref": results[(n, "ref")],
                        "traced": traced[n],
                    }
                )
            if size_mib == max(sizes_mib):
                # Importing Airflow (for ObjectStoragePath) must not touch the user's AIRFLOW_HOME.
                env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
                env["AIRFLOW_HOME"] = str(base / "airflow-home")
                breakdown = _call("breakdown", env=env, store=str(store), reps=reps, object_storage_path=not quick)
                breakdown["size_mib"] = size_mib
            if not keep:
                shutil.rmtree(store, ignore_errors=True)
    finally:
        if keep:
            log(f"[fedavg] kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    assert breakdown is not None
    return [_throughput_table(rows, reps), _breakdown_table(breakdown)]


def _throughput_table(rows: list[dict[str, Any]], reps: int) -> Table:
    table = Table(
        "FedAvg (`fedavg_from_store`) throughput and peak memory, side by side with numpy on the same bytes",
        [
            "update",
            "N",
            "data GB",
            "ours s",
            "ours GB/s",
            "(a) readinto GB/s",
            "(b) `acc += a*w` GB/s",
            "ours / (a)",
            "ours / (b)",
            "peak RSS over baseline MiB",
            "peak / update",
            "tracemalloc peak MiB",
        ],
    )
    peaks: dict[int, dict[int, float]] = {}
    for row in rows:
        ours, ref = row["ours"], row["ref"]
        ours_bw = [gbps(o["bytes"], o["seconds"]) for o in ours]
        read_bw = [gbps(r["read_bytes"], r["read_seconds"]) for r in ref]
        madd_bw = [gbps(r["madd_bytes"], r["madd_seconds"]) for r in ref]
        peak = median([o["peak_delta"] for o in ours]) / MIB
        peaks.setdefault(row["size_mib"], {})[row["n"]] = peak
        table.add(
            f"{row['size_mib']} MiB",
            row["n"],
            f"{ours[0]['bytes'] / 1e9:.2f}",
            f"{median([o['seconds'] for o in ours]):.2f}",
            f"{median(ours_bw):.2f} ({spread(ours_bw)})",
            f"{median(read_bw):.2f}",
            f"{median(madd_bw):.2f}",
            f"{median([o / r for o, r in zip(ours_bw, read_bw, strict=True)]):.2f}",
            f"{median([o / m for o, m in zip(ours_bw, madd_bw, strict=True)]):.2f}",
            f"{peak:.0f}",
            f"{peak / row['size_mib']:.2f}x",
            f"{row['traced']['traced_peak'] / MIB:.0f}",
        )
    growth = "; ".join(
        f"{size} MiB: N={max(p)} / N={min(p)} = {p[max(p)] / p[min(p)]:.2f}" for size, p in sorted(peaks.items())
    )
    reset = all(o["hwm_reset"] for row in rows for o in row["ours"])
    table.notes += [
        f"Medians of {reps} repetitions (ours and the numpy references alternating, order rotated each repetition; "
        "each in a fresh subprocess). Throughput = N x update file size / time, GB = 10^9 bytes. Updates: 4 float32 "
        "tensors each, written once with `write_artifact` into a temporary store on disk and read back from a hot "
        "page cache (RAM is far larger than the data; an untimed pass reads every file first). The time includes "
        "computing the new global model once.",
        "(a) = `readinto` of the same files into a preallocated, touched buffer; (b) = "
        "`acc += a * np.float64(w)` in memory over the same tensors (float32 -> float64), N times.",
        "Peak memory: "
        + (
            "the kernel's RSS high-water mark (VmHWM, the counter ru_maxrss reports), reset through "
            "/proc/self/clear_refs after the imports and after loading the global model, minus the RSS at that "
            "point."
            if reset
            else "ru_maxrss after the run minus ru_maxrss after imports and loading the global model (could not "
            "reset the high-water mark, so this underestimates)."
        )
        + " tracemalloc peak (numpy reports its buffers to tracemalloc) comes from a separate, untimed run. "
        "Expected ≈ 4x an update: the float64 accumulator (2x) + the file's bytes (1x) + the parsed copy of its "
        f"tensors (1x) while the next update is parsed. Growth with N (peak ratio): {growth}.",
    ]
    return table


def _breakdown_table(b: dict[str, Any]) -> Table:
    t: dict[str, list[float]] = b["times"]
    nbytes = b["bytes"]
    stages = [
        ("read", "`path.open('rb').read()` (new bytes object)"),
        ("sha256", "`hashlib.sha256(data).hexdigest()`"),
        ("parse", "`parse_safetensors(data)` (copies every tensor out of the bytes)"),
        ("finite", "finite check: `all_finite(params)` (`np.isfinite(arr).all()`)"),
        ("accumulate", "accumulate: `acc[name] += arr * np.float64(w)` (float64 temporary per tensor)"),
    ]
    total = sum(median(t[k]) for k, _ in stages)
    table = Table(
        f"Where the time goes for one {b['size_mib']} MiB update (steady state, medians of {len(t['read'])} updates)",
        ["stage", "ms", "GB/s", "share"],
    )
    for key, label in stages:
        m = median(t[key])
        table.add(label, f"{1000 * m:.0f}", f"{gbps(nbytes, m):.2f}", f"{100 * m / total:.0f} %")
    table.add("**sum of the stages**", f"**{1000 * total:.0f}**", f"**{gbps(nbytes, total):.2f}**", "100 %")
    together = median(t["together"])
    table.add(
        "`read_artifact` + `FedAvg.add`, timed together",
        f"{1000 * together:.0f}",
        f"{gbps(nbytes, together):.2f}",
        f"{100 * together / total:.0f} %",
    )
    alternatives = [
        ("alt_readinto", "alternative read: `readinto` a reused, preallocated buffer"),
        ("alt_parse", "alternative parse: zero-copy `np.frombuffer` views into the bytes"),
        ("alt_fused", "alternative: multiply-add + finite check fused in 1 MiB chunks (no big temporaries)"),
        ("alt_osp_read", "read via Airflow's `ObjectStoragePath` (what the aggregation task passes)"),
    ]
    for key, label in alternatives:
        if key in t:
            m = median(t[key])
            rate = f"{gbps(nbytes, m):.2f}" if m >= 1e-3 else "(no copy)"
            table.add(f"*{label}*", f"{1000 * m:.1f}" if m < 0.01 else f"{1000 * m:.0f}", rate, "")
    table.notes.append(
        "Stages use the package's own calls in its order (`read_artifact`, then `validate_update` -- whose name/shape/"
        "dtype checks take microseconds -- then the accumulation in `FedAvg.add`), one update after another in one "
        "process after an untimed warm-up update (the first update of a round also pays first-touch page faults). "
        "Rows in italics are measured alternatives, not what the package does."
    )
    return table


def main_worker(argv: list[str]) -> int:
    kind, args = argv[0], json.loads(argv[1])
    result = WORKERS[kind](args)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "worker":
        os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
        sys.exit(main_worker(sys.argv[2:]))
    sys.exit("run benchmarks/run.py; this module is its FedAvg part")
