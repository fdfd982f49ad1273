"""Trust (issue 36): what signing and verifying the records costs, side by side with today's checks.

1. At 256 MiB (one float32 update): the digest check that exists (the site task hashes the update
   once, the aggregation verifies the file against the digest once: sha256 + BLAKE3 through
   ``read_verified``) next to what trust adds -- the site loading its key and signing the update
   record, the aggregation reading the registry and verifying that record. The record carries
   the digests, so nothing is hashed twice: the added cost does not grow with the update.
2. A hello round (2 sites x 1 round, no-op trainer, the embedded default through
   ``flare-airflow run``) with the code before trust (the base commit's ``flare_airflow``, put
   first on ``PYTHONPATH``) and with it, alternating, each in its own Airflow home.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import MIB, Table, log, median, rotate, spread
from bench_e2e import CASES, Runner, migrate, write_dags

from flare_airflow.core.model import FLModel, read_record, read_verified, write_artifact
from flare_airflow.core.trust import CENTRAL, sign_record, update_payload, verify_record
from flare_airflow.core.trust.settings import TrustSettings

REPO = Path(__file__).resolve().parents[1]
# The code before trust: the commit this work started from.
BASE_COMMIT = "29040e6"


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def micro(reps: int, size_mib: int, tmp: Path) -> Table:
    settings = TrustSettings(key_dir=str(tmp / "keys"))
    settings.signing_key("site-1")
    settings.signing_key(CENTRAL)
    path = tmp / "update.safetensors"
    n = size_mib * MIB // 4
    record = write_artifact(path, FLModel(params={"w": np.random.default_rng(0).standard_normal(n, np.float32)}))
    holder: dict[str, Any] = {}

    def sign() -> None:  # what the site task adds: load its key from disk, sign the record
        kid, key = settings.signing_key("site-1")
        p = update_payload(
            job="bench", run_id="r", round_num=1, site="site-1", try_number=1, size=record.size,
            sha256=record.sha256, blake3=record.blake3, num_samples=10, params_type="FULL", privacy=None,
            trainer="0" * 64,
        )  # fmt: skip
        holder["signed"] = sign_record(p, kid, key)

    def verify() -> None:  # what the aggregation adds: read the registry, verify the record
        verify_record(holder["signed"], settings.registry(), party="site-1", expect={"round": 1}, what="u")

    def check() -> None:  # what exists: the file against its record's digests
        read_verified(path, read_record(path))

    cases = {"digest check of the update (today)": check, "sign the update record (new)": sign,
             "verify the update record (new)": verify}  # fmt: skip
    sign()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(reps):
        for name in rotate(list(cases), rep):
            times[name].append(_timed(cases[name]))
    base = median(times["digest check of the update (today)"])
    table = Table(
        f"Signing and verifying next to the digest check, one {size_mib} MiB update",
        ["operation", "median ms", "min-max ms", "share of the digest check"],
    )
    for name, values in times.items():
        table.add(name, f"{median(values) * 1e3:.2f}", spread([v * 1e3 for v in values]),
                  f"{median(values) / base * 100:.3f} %")  # fmt: skip
    table.notes.append(
        f"{reps} repetitions, cases alternating. The digest check reads the file and computes sha256 and BLAKE3 "
        "(`read_verified`, as the aggregation does); signing loads the site's key from disk and signs the record "
        "that already carries the digests; verifying reads the registry and checks one Ed25519 signature."
    )
    return table


_IMPORT = """
import time
import flare_airflow.site_task.runner, flare_airflow.core.aggregation.update_reader  # the runner loaded these
start = time.perf_counter()
import flare_airflow.core.trust
print(time.perf_counter() - start)
"""


def runner_import(reps: int) -> Table:
    """The one cost trust adds to a site job that does not stay in the microseconds: the site
    runner (a fresh interpreter) importing ``cryptography`` to sign; it happens while the trainer runs."""
    times = [float(subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True,
                                  check=True).stdout) for _ in range(reps)]  # fmt: skip
    table = Table(
        "The site runner's import of the signing code (a fresh interpreter)", ["step", "median ms", "min-max ms"]
    )
    table.add("import flare_airflow.core.trust (cryptography)", f"{median(times) * 1e3:.1f}",
              spread([t * 1e3 for t in times], "{:.1f}"))  # fmt: skip
    table.notes.append(
        "The runner imports it while the trainer runs (next to numpy), so it is off the site job's critical path "
        "unless the trainer ends in less time than the import takes."
    )
    return table


def hello_round(reps: int, tmp: Path) -> Table:
    old_src = tmp / "old-src"
    old_src.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", BASE_COMMIT, "flare_airflow"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(old_src)], input=archive.stdout, check=True)
    runners = {"before trust": Runner(tmp / "old", via_cli=True), "with trust": Runner(tmp / "new", via_cli=True)}
    runners["before trust"].env["PYTHONPATH"] = str(old_src)
    case = next(c for c in CASES if c.dag_id == "bench_r1")
    for name, runner in runners.items():
        write_dags(runner.dags)
        migrate(runner.env, runner.home)
        runner.run(case)  # untimed: the first run serialises the DAG
        log(f"[trust] {name}: ready")
    times: dict[str, list[float]] = {name: [] for name in runners}
    for rep in range(reps):
        for name in rotate(list(runners), rep):
            result = runners[name].run(case)
            times[name].append(result.dags_test_seconds)
            log(f"[trust] rep {rep + 1}/{reps} {name}: {result.dags_test_seconds:.2f}s")
    made = {name: any((tmp / sub / "home").rglob("sign.pem")) for name, sub in (("new", "new"), ("old", "old"))}
    if not made["new"] or made["old"]:
        raise RuntimeError(f"the two cases did not run the code they name (signing keys made: {made})")
    base = median(times["before trust"])
    table = Table(
        "A hello round before and with trust (2 sites x 1 round, `flare-airflow run`, embedded default)",
        ["code", "`airflow dags test` s (median)", "min-max", "vs before"],
    )
    for name, values in times.items():
        table.add(name, f"{median(values):.2f}", spread(values), f"{median(values) / base:.3f}x")
    table.notes.append(
        f"{reps} repetitions, alternating; each case in its own Airflow home after one untimed run. 'before trust' "
        f"runs commit {BASE_COMMIT}'s flare_airflow (first on PYTHONPATH); 'with trust' this tree, one-machine mode "
        "(keys made on first use: the timed runs sign and verify 1 global record per site task, 2 update records "
        "and 2 global records per run)."
    )
    return table


def run(*, reps: int, keep: bool, tmp_base: str | None) -> list[Table]:
    tmp = Path(tempfile.mkdtemp(prefix="flare-bench-trust-", dir=tmp_base))
    ok = False
    try:
        tables = [micro(max(reps, 5), 256, tmp), runner_import(max(reps, 5)), hello_round(reps, tmp)]
        ok = True
    finally:
        if keep or not ok:
            log(f"[trust] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return tables
