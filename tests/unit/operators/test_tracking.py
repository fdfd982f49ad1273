"""The tracking writes of the run's own tasks (where they go: test_tracking_target.py)."""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow.operators import tracking
from tests.unit.operators.test_tracking_target import tracked_job


def test_the_success_line_shows_no_credentials(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib
    from types import SimpleNamespace

    class Writer:
        tracking_uri = "https://m.example/mlflow?auth_token=tok-35"

        @contextlib.contextmanager
        def session(self):
            yield self

        def write(self, *args: object, **kwargs: object) -> dict[str, object]:
            return {"experiment_id": "1", "run_id": "r", "differ": [], "model_version": None}

    lines: list[str] = []
    log = SimpleNamespace(info=lambda m, *a: lines.append(m % a), warning=lambda m, *a: lines.append(m % a))
    monkeypatch.setattr(tracking, "_writer", lambda job, store: Writer())
    context = {"ti": SimpleNamespace(dag_id="flare_demo"), "run_id": "manual__1", "params": {}}
    tracking._write_mlflow(tracked_job(tmp_path), context, log, "run start", [], None)
    assert lines == [
        "experiment tracking (run start): MLflow experiment 1, run r at https://m.example/mlflow?auth_token=***"
    ]
