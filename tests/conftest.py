"""Shared fixtures. The Airflow harness lives in flare_airflow_testing/harness.py."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from flare_airflow_testing.background import background_last
from flare_airflow_testing.harness import AirflowHome

# The Kubernetes control plane and LOCAL NODE AGENT fixtures, shared by integration and e2e tests
# (session-scoped: one control plane per test session).
from flare_airflow_testing.k8s.fixtures import audit, control_plane, core, namespace, node_agent  # noqa: F401

# The real single-node SLURM cluster (munged, slurmctld, slurmd, fake GPUs), session-scoped.
from flare_airflow_testing.slurm.fixtures import slurm, slurm_cluster, sshd  # noqa: F401

# One PostgreSQL cluster per worker; each scheduler-level module's stack gets a database in it.
from flare_airflow_testing.stack import postgres  # noqa: F401
from flare_airflow_testing.tier_times import CPU_PROPERTY, CpuLap, TierTimes

# NVIDIA FLARE's and PyTorch's side environments and the jobs NVFlare exports at test time.
from tests.integration.nvflare.fixtures import nvflare_exports, nvflare_side, torch_side  # noqa: F401

_TIER_TIMES = TierTimes()
_CPU = CpuLap()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # `make test` builds the control plane and the LM side environment in the background meanwhile
    # (flare_airflow_testing/background.py): the modules that need them run last.
    items[:] = background_last(items)


def pytest_collection_finish() -> None:
    _CPU.lap()  # collection's CPU is no test's


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # In the process that ran the phase (a pytest-xdist worker sends its user properties along).
    report: pytest.TestReport = yield
    report.user_properties.append((CPU_PROPERTY, _CPU.lap()))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _TIER_TIMES.add(report)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.section("time per tier (docs/testing.md gives each tier's budget)")
    for line in _TIER_TIMES.table():
        terminalreporter.write_line(line)
    terminalreporter.section("costliest modules (test-minutes: setup, tests and teardown)")
    for line in _TIER_TIMES.costliest_modules():
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _own_privacy_ledger(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test's site tasks charge a privacy ledger of their own (docs/privacy.md), never the one
    under the developer's $AIRFLOW_HOME, whose releases would outlive the test. (The session's
    Airflow home copies the first test's value: its runs share one ledger, each under its own run.)"""
    ledger = tmp_path_factory.mktemp("ledger") / "privacy-ledger.sqlite"
    monkeypatch.setenv("FLARE_PRIVACY_LEDGER", str(ledger))


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> AirflowHome:
    """A private Airflow home (SQLite, migrated once per session) with its own dags folder."""
    return AirflowHome(tmp_path_factory.mktemp("airflow"))


@pytest.fixture(scope="session")
def trainer_image() -> str:
    """The site trainer image of this tree, built once per session when missing (docker/images.py
    caches it by content, so a warm machine builds nothing). Container-site tests share it."""
    from flare_airflow_testing.containers import trainer_image as build

    return build()
