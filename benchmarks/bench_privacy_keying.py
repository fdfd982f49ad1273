"""Privacy keying and the site's ledger: what issue 34 adds to a site task's round.

Side by side, per update (float32 DIFF, one tensor), in one process:
- the old keying: clip + noise drawn from a key of (job, run, round, site) alone;
- the new keying: clip + SHA-256 of the clipped float64 update (``clipped_digest``) + noise drawn
  from the release's key (``release_noise_key``) -- what ``apply_filters`` runs now;
- the digest alone;
and per round, the site's ledger (``PrivacyLedger``, SQLite, synchronous=FULL): the check before
launch and the charge before publishing, on a ledger already holding 1,000 releases.
"""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import MIB, Table, log, median, rotate, spread

from flare_airflow.core.privacy.filters import (
    add_gaussian_in_place,
    clip_in_place,
    clipped_digest,
    noise_generator,
    noise_key,
    release_noise_key,
)
from flare_airflow.core.privacy.ledger import Budget, PrivacyLedger

KEY = noise_key(b"benchmark" * 4, "bench", "run", 1, "site-1")
STEP = {"index": 0, "clip": 1.0, "noise_multiplier": 1.0}


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _keying_cases(update: np.ndarray) -> dict[str, Any]:
    def old() -> None:
        diff = {"x": update.astype(np.float64)}
        clip_in_place(diff, 1.0)
        add_gaussian_in_place(diff, 1.0, noise_generator(KEY, 0))

    def new() -> None:
        diff = {"x": update.astype(np.float64)}
        clip_in_place(diff, 1.0)
        digest = clipped_digest(diff, STEP)
        add_gaussian_in_place(diff, 1.0, noise_generator(release_noise_key(KEY, digest), 0))

    diff64 = {"x": update.astype(np.float64)}
    return {
        "clip + noise, keyed by identity (old)": old,
        "clip + digest + noise, keyed by release (new)": new,
        "clipped_digest alone (SHA-256 of the float64 update)": functools.partial(clipped_digest, diff64, STEP),
    }


def keying(sizes_mib: list[int], reps: int) -> Table:
    table = Table(
        "Keying the noise: old (identity) vs new (identity + clipped update's digest), per update",
        ["update", "operation", "s (median)", "s (min-max)", "x old keying"],
    )
    for size in sizes_mib:
        n = size * MIB // 4
        update = np.random.default_rng(0).standard_normal(n).astype(np.float32)

        cases = _keying_cases(update)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(reps):
            for name in rotate(list(cases), rep):
                times[name].append(_timed(cases[name]))
        base = median(times["clip + noise, keyed by identity (old)"])
        for name, values in times.items():
            s = median(values)
            table.add(f"{size} MiB", name, f"{s:.4f}", spread(values, "{:.4f}"), f"{s / base:.3f}")
        log(f"[privacy-keying] {size} MiB done")
    return table


def ledger(reps: int, existing: int = 1000) -> Table:
    table = Table(
        f"The site's ledger per round (SQLite file, {existing} releases already in it)",
        ["operation", "ms (median)", "ms (min-max)"],
    )
    with tempfile.TemporaryDirectory() as tmp:
        book = PrivacyLedger(Path(tmp) / "ledger.sqlite")
        for i in range(existing):
            book.charge(
                site="site-1", release_id=f"old{i}", job="j", run_id="r0", round_num=i, noise_multiplier=1000.0,
                budget=None,
            )  # fmt: skip
        budget = Budget(max_epsilon=1e9, delta=1e-5)
        times: dict[str, list[float]] = {"check before launch": [], "charge before publishing": [], "republish": []}
        for rep in range(max(reps, 5) * 4):
            times["check before launch"].append(_timed(lambda: book.check("site-1", 1.0, budget)) * 1000)
            charge = functools.partial(
                book.charge, site="site-1", release_id=f"new{rep}", job="j", run_id="r1", round_num=rep,
                noise_multiplier=2.0, budget=budget,
            )  # fmt: skip
            times["charge before publishing"].append(_timed(charge) * 1000)
            times["republish"].append(_timed(charge) * 1000)
        for name, values in times.items():
            table.add(name, f"{median(values):.2f}", spread(values, "{:.2f}"))
    table.notes.append(
        "A charge is one BEGIN IMMEDIATE transaction with synchronous=FULL (an fsync); the check reads every "
        "release of the site to compose them exactly (sqrt of the sum of mu squared, then the closed-form curve)."
    )
    return table


def run(reps: int, quick: bool) -> list[Table]:
    return [keying([4] if quick else [4, 16, 64], reps), ledger(reps)]


if __name__ == "__main__":
    for t in run(reps=int(sys.argv[1]) if len(sys.argv) > 1 else 5, quick=False):
        print(t.markdown())
