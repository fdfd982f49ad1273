"""Shared fixtures. The Airflow harness lives in tests/harness.py."""

from __future__ import annotations

import pytest

from tests.harness import AirflowHome


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> AirflowHome:
    """A private Airflow home (SQLite, migrated once per session) with its own dags folder."""
    return AirflowHome(tmp_path_factory.mktemp("airflow"))
