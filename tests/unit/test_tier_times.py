"""The per-tier time table printed at the end of the suite."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flare_airflow_testing.tier_times import CPU_PROPERTY, CpuLap, TierTimes, tier_of


def report(nodeid: str, when: str, duration: float, outcome: str = "passed", cpu: float = 0.0) -> pytest.TestReport:
    return pytest.TestReport(
        nodeid, ("f", 1, "t"), {}, outcome, None, when, duration=duration, user_properties=[(CPU_PROPERTY, cpu)]
    )


def test_tier_is_the_first_folder_under_tests() -> None:
    assert tier_of("tests/e2e/test_demo.py::test_demo") == "e2e"
    assert tier_of("tests/unit/core/test_model.py::test_x[a/b]") == "unit"
    assert tier_of("tests/test_top.py::test_x") == "other"
    assert tier_of("benchmarks/test_b.py::test_x") == "other"


def test_setup_and_teardown_count_with_their_tier_and_each_test_once() -> None:
    times = TierTimes()
    times.add(report("tests/e2e/test_a.py::t", "setup", 30.0))
    times.add(report("tests/e2e/test_a.py::t", "call", 60.0))
    times.add(report("tests/e2e/test_a.py::t", "teardown", 6.0))
    times.add(report("tests/unit/test_b.py::t", "call", 0.5))
    times.add(report("tests/unit/test_b.py::s", "setup", 0.1, outcome="skipped"))
    assert times.seconds == {"e2e": 96.0, "unit": 0.6}
    assert times.tests == {"e2e": 1, "unit": 2}
    rows = times.table()
    assert rows[2].split("|")[0].strip() == "e2e", "the costliest tier comes first"
    assert "1.6" in rows[2] and "99%" in rows[2]
    assert rows[-1].startswith("(sum)") and "|     3 |" in rows[-1]


def test_modules_are_ranked_by_the_time_their_stacks_and_tests_took() -> None:
    times = TierTimes()
    times.add(report("tests/e2e/test_a.py::t", "setup", 30.0, cpu=24.0))
    times.add(report("tests/e2e/test_a.py::t", "call", 30.0, cpu=6.0))
    times.add(report("tests/unit/test_b.py::t", "call", 120.0, cpu=3.0))
    times.add(report("tests/unit/test_c.py::t[x::y]", "call", 6.0))
    rows = times.costliest_modules(count=2)
    assert [row.split()[-1] for row in rows[1:]] == ["tests/unit/test_b.py", "tests/e2e/test_a.py"]
    assert rows[1].split()[:3] == ["2.0", "65%", "0.1"], rows[1]
    assert rows[2].split()[:3] == ["1.0", "32%", "0.5"], rows[2]


def test_a_cpu_lap_counts_the_children_a_test_started_and_reaped() -> None:
    lap = CpuLap()
    lap.lap()
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert lap.lap() >= 0.3
