"""The large-round benchmark runs: its aggregation is a subprocess importing the package by path,
so a move inside ``core/aggregation`` breaks it silently unless something runs it (one did)."""

from __future__ import annotations

import subprocess
import sys

from flare_airflow_testing.harness import REPO


def test_a_small_round_of_ours_runs_and_reports_its_peak() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_large_round.py"), "--sites", "2", "--size-mib", "1",
         "--skip-nvflare"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| flare-airflow"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) > 0  # peak server memory (GiB), measured by the kernel
    assert "aggregation" in cells[4]
