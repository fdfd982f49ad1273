"""The suite's time per tier, printed at the end of every pytest run (docs/testing.md gives each
tier's budget).

A tier is the first folder under ``tests/`` (unit, bad_inputs, integration, e2e). Setup and
teardown count with the test that paid them, so a session-scoped control plane is charged to the
tier of the first test that asked for it. Wall time is the whole session's. Serially the tiers'
sum is a little less (collection, the gaps between tests); with pytest-xdist workers (``make test``
runs two) the minutes are test time summed over the workers, and the wall time is what it cost.

On two cores CPU is the scarcer thing: each report also carries the CPU seconds its phase used
(:class:`CpuLap`: the test process and every process it started and reaped -- an Airflow stack and
the task processes its scheduler reaped count when the stack stops; daemons kept for the whole
session, such as the control plane, count nowhere), so that the costliest modules are ranked by
both.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import pytest


@dataclass
class TierTimes:
    """Seconds and test counts per tier, filled from each test's reports."""

    started: float = field(default_factory=time.monotonic)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    tests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Seconds per test module (setup, tests and teardown of its stacks): where a tier's time goes.
    module_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: CPU seconds per test module (see :class:`CpuLap`).
    module_cpu: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, report: pytest.TestReport) -> None:
        tier = tier_of(report.nodeid)
        self.seconds[tier] += report.duration
        module = report.nodeid.split("::", 1)[0]
        self.module_seconds[module] += report.duration
        self.module_cpu[module] += dict(report.user_properties).get(CPU_PROPERTY, 0.0)
        if report.when == "call" or (report.when == "setup" and report.skipped):
            self.tests[tier] += 1

    def table(self) -> list[str]:
        total = sum(self.seconds.values())
        lines = [
            "tier        | tests | minutes | share",
            "------------+-------+---------+------",
        ]
        for tier in sorted(self.seconds, key=self.seconds.__getitem__, reverse=True):
            share = self.seconds[tier] / total if total else 0.0
            lines.append(f"{tier:<11} | {self.tests[tier]:>5} | {self.seconds[tier] / 60:>7.1f} | {share:>5.0%}")
        wall = time.monotonic() - self.started
        lines.append(f"{'(sum)':<11} | {sum(self.tests.values()):>5} | {total / 60:>7.1f} | wall {wall / 60:.1f} min")
        return lines

    def costliest_modules(self, count: int = 15) -> list[str]:
        """The ``count`` modules that took the most test time, costliest first: test-minutes, their
        share, and the CPU minutes they used."""
        total = sum(self.module_seconds.values()) or 1.0
        ranked = sorted(self.module_seconds.items(), key=lambda kv: kv[1], reverse=True)[:count]
        lines = [" test-min share cpu-min  module"]
        for module, seconds in ranked:
            cpu = self.module_cpu.get(module, 0.0)
            lines.append(f"{seconds / 60:>9.1f} {seconds / total:>5.0%} {cpu / 60:>7.1f}  {module}")
        return lines


#: The user property of a test report that carries the CPU seconds its phase used.
CPU_PROPERTY = "cpu_seconds"


class CpuLap:
    """CPU seconds (user + system) of this process and of its reaped children since the last lap."""

    def __init__(self) -> None:
        self.last = self.now()

    @staticmethod
    def now() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def lap(self) -> float:
        now = self.now()
        spent, self.last = now - self.last, now
        return spent


def tier_of(nodeid: str) -> str:
    """``tests/e2e/test_x.py::test_y`` -> ``e2e``; anything outside ``tests/<tier>/`` -> ``other``."""
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
