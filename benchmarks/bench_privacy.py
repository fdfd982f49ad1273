"""Privacy: the site's filters' cost per update, and what the noise costs in accuracy.

1. Cost per update at 16 and 256 MiB (float32, one DIFF update): our clip, gaussian (clip + noise)
   and percentile filters (``core.privacy.filters.apply_filters``, as the site task runs them) side
   by side with NumPy's plain ``x += rng.standard_normal(n, float32)`` and with a plain copy of
   the same bytes (``np.copyto``): clip and noise are memory-bound, so each row is also given as a
   fraction of this machine's copy bandwidth.
2. Utility: the digits demo (examples/digits, 4 non-IID sites, 5 rounds, the demo job's
   hyper-parameters), each site's update through the same ``apply_filters`` and the rounds through
   the same ``FedAvg`` as a run, in one process (the Airflow machinery is not what is measured),
   for a few (z, C) next to the ε at δ = 1e-5 each spends.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import MIB, Table, gbps, log, median, rotate, spread

from flare_airflow.core.aggregation.streaming import FedAvg
from flare_airflow.core.model import ArtifactRecord, ParamsType
from flare_airflow.core.privacy.accountant import epsilon_after
from flare_airflow.core.privacy.filters import (
    ClipFilter,
    GaussianFilter,
    PercentileFilter,
    SiteFilter,
    apply_filters,
    noise_key,
)

REPO = Path(__file__).resolve().parents[1]
DELTA = 1e-5
KEY = noise_key(b"benchmark", "bench", "run", 1, "site-1")


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cases(n: int) -> dict[str, Any]:
    """The operations compared on one update of ``n`` float32 elements."""
    rng = np.random.default_rng(0)
    update = {"w": (rng.standard_normal(n, dtype=np.float32) * np.float32(0.01))}
    glob = {"w": np.zeros(n, np.float32)}
    dst = np.zeros_like(update["w"])  # touched once here: the copy measures bandwidth, not page faults
    plain = update["w"].copy()
    clip = float(np.linalg.norm(update["w"].astype(np.float64))) / 2  # every update is scaled
    return {
        "copy (np.copyto)": lambda: np.copyto(dst, update["w"]),
        "numpy rng.standard_normal(float32) + add": lambda: plain.__iadd__(
            np.random.default_rng(1).standard_normal(n, dtype=np.float32)
        ),
        "clip": lambda: apply_filters(update, glob, diff_update=True, steps=[ClipFilter(clip=clip)], key=None),
        "gaussian (clip + noise)": lambda: apply_filters(
            update,
            glob,
            diff_update=True,
            steps=[GaussianFilter(clip=clip, noise_multiplier=1.0)],
            key=KEY,
        ),
        "percentile (NVFlare's, not DP)": lambda: apply_filters(
            update,
            glob,
            diff_update=True,
            steps=[PercentileFilter(percentile=10, gamma=0.01)],
            key=None,
        ),
    }


def cost(sizes_mib: list[int], reps: int) -> Table:
    table = Table(
        "Filters' cost per update (float32 DIFF, one tensor), median of repetitions",
        [
            "update",
            "operation",
            "s (median)",
            "s (min-max)",
            "GB/s of update",
            "x copy bandwidth",
            "x numpy normal+add",
        ],
    )
    for size in sizes_mib:
        n = size * MIB // 4
        cases = _cases(n)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(reps):
            for name in rotate(list(cases), rep):
                times[name].append(_timed(cases[name]))
        del cases
        nbytes = n * 4
        copy_gbps = gbps(nbytes, median(times["copy (np.copyto)"]))
        numpy_s = median(times["numpy rng.standard_normal(float32) + add"])
        for name, values in times.items():
            s = median(values)
            table.add(
                f"{size} MiB",
                name,
                f"{s:.3f}",
                spread(values, "{:.3f}"),
                f"{gbps(nbytes, s):.2f}",
                f"{gbps(nbytes, s) / copy_gbps:.3f}",
                f"{s / numpy_s:.2f}",
            )
        log(f"[privacy] {size} MiB done")
    table.notes.append(
        "x copy bandwidth: the update's bytes per second over np.copyto's (1.0 = as fast as copying the update "
        "once). The filters work on a float64 difference (exact for float32 inputs; the clip norm in float64) "
        "and draw float64 noise: that, and the cast back, is their cost over NumPy's plain float32 normal + add."
    )
    return table


def _digits() -> Any:
    spec = importlib.util.spec_from_file_location("digits_trainer", REPO / "examples" / "digits" / "trainer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def utility(rounds: int = 5) -> Table:
    d = _digits()
    x_train, x_test, y_train, y_test = d.load_split(0)
    shards = d.partition(y_train, 4, 0.5, 0)
    settings: list[tuple[str, list[SiteFilter]]] = [("none", [])]
    for c in (1.0, 5.0):
        settings.append((f"clip C={c:g}", [ClipFilter(clip=c)]))
    for z, c in ((0.1, 5.0), (0.2, 5.0), (0.5, 5.0), (1.0, 1.0), (1.0, 5.0), (2.0, 5.0)):
        settings.append((f"gaussian z={z:g} C={c:g}", [GaussianFilter(clip=c, noise_multiplier=z)]))
    table = Table(
        f"Utility: digits demo, 4 sites, {rounds} rounds, local DP at every site",
        ["filter", "test accuracy", "ε at δ=1e-5 after 5 rounds", "median update norm (round 1)"],
    )
    for name, steps in settings:
        glob = {"weight": np.zeros((64, 10), np.float32), "bias": np.zeros(10, np.float32)}
        norms: list[float] = []
        for r in range(1, rounds + 1):
            agg = FedAvg(glob, min_clients=4)
            for i, shard in enumerate(shards):
                w, b = d.train(
                    glob["weight"], glob["bias"], x_train[shard], y_train[shard],
                    lr=0.5, epochs=10, batch_size=16, seed=r * 101 + i,
                )  # fmt: skip
                sent = {"weight": w, "bias": b}
                if r == 1:
                    diff = np.concatenate([(w - glob["weight"]).ravel(), (b - glob["bias"]).ravel()])
                    norms.append(float(np.linalg.norm(diff)))
                key = noise_key(b"bench", "digits", name, r, f"site-{i + 1}")
                out = apply_filters(sent, glob, diff_update=False, steps=steps, key=key)
                record = ArtifactRecord("0" * 64, 0, ParamsType.FULL, len(shard), {}, {}, {})
                agg.add(f"site-{i + 1}", out.params, record)
            glob = agg.result().params
        _, acc = d.loss_and_accuracy(glob["weight"], glob["bias"], x_test, y_test)
        zs = [float(s.params["noise_multiplier"]) for s in steps if s.type == "gaussian"]
        eps = f"{epsilon_after(zs[0], rounds, DELTA):.2f}" if zs else "∞ (no noise)"
        table.add(name, f"{acc:.3f}", eps, f"{median(norms):.2f}")
        log(f"[privacy] utility {name}: accuracy {acc:.3f}")
    table.notes.append(
        "Each site clips and noises its own update (local DP; ε for adding or removing one site's data) and the "
        "server takes FedAvg's sample-weighted mean. The same filters and FedAvg code as a run; the sites' "
        "training is the demo trainer's train(), in one process."
    )
    return table


def run(reps: int, quick: bool) -> list[Table]:
    return [cost([16] if quick else [16, 256], reps), utility()]


if __name__ == "__main__":
    for t in run(reps=int(sys.argv[1]) if len(sys.argv) > 1 else 3, quick=False):
        print(t.markdown())
