"""The tracking writes of the run's own tasks (where they go: test_tracking_target.py)."""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow.core.config import job_from_dict
from flare_airflow.operators import tracking

REPO = pathlib.Path(__file__).resolve().parents[3]


def _job(tmp_path: pathlib.Path, **spec: str):
    (tmp_path / "train.py").write_text("")
    return job_from_dict(
        {
            "job": "demo",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(REPO / "examples" / "digits" / "initial_model.safetensors"),
            "trainer": {"script": "train.py"},
            "tracking": {"backend": "mlflow", **spec},
            "sites": {"site-1": {}},
        },
        base_dir=str(tmp_path),
    )


def _connections(monkeypatch: pytest.MonkeyPatch, **uris: str) -> None:
    """Connections as a deployment gives them to Airflow: AIRFLOW_CONN_* variables (URI or JSON)."""
    for conn_id, uri in uris.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", uri)


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
    tracking._write_mlflow(_job(tmp_path), context, log, "run start", [], None)
    assert lines == [
        "experiment tracking (run start): MLflow experiment 1, run r at https://m.example/mlflow?auth_token=***"
    ]
