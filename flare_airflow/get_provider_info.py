"""Airflow provider metadata (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    from flare_airflow import __version__

    return {
        "package-name": "flare-airflow",
        "name": "Federated learning (flare-airflow)",
        "description": "Federated learning on Airflow: a task per site and round, FedAvg per round.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Federated learning",
                "external-doc-url": "https://nvflare.readthedocs.io/",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "Federated learning",
                # Each backend's site-task module (operators/bindings.py binds them), then the
                # backend-neutral ones; tests/unit/test_get_provider_info.py checks the list is whole.
                "python-modules": [
                    "flare_airflow.operators.site",
                    "flare_airflow.operators.pod",
                    "flare_airflow.operators.slurm",
                    "flare_airflow.operators.container",
                    "flare_airflow.operators.site_job",
                    "flare_airflow.operators.aggregate",
                    "flare_airflow.operators.prepare",
                    "flare_airflow.operators.publish",
                    "flare_airflow.operators.verdict",
                    "flare_airflow.operators.sweep",
                    "flare_airflow.operators.pod_sweep",
                    "flare_airflow.operators.nvflare_native",
                    "flare_airflow.operators.data_ready",
                    "flare_airflow.operators.data_watch",
                ],
            }
        ],
        "sensors": [{"integration-name": "Federated learning", "python-modules": ["flare_airflow.sensors.site_job"]}],
        # The Federated runs page (also registered through the ``airflow.plugins`` entry point;
        # Airflow loads a plugin name once).
        "plugins": [{"name": "flare_airflow", "plugin-class": "flare_airflow.ui.plugin.FlareAirflowPlugin"}],
        "triggers": [
            {
                "integration-name": "Federated learning",
                # Each watchable backend's trigger module, then NVFlare native mode's.
                "python-modules": [
                    "flare_airflow.triggers.pod_state",
                    "flare_airflow.triggers.slurm_state",
                    "flare_airflow.triggers.container_state",
                    "flare_airflow.triggers.flare_job",
                ],
            }
        ],
        "hooks": [{"integration-name": "Federated learning", "python-modules": ["flare_airflow.hooks.flare_admin"]}],
        "connection-types": [
            {"connection-type": "nvflare", "hook-class-name": "flare_airflow.hooks.flare_admin.FlareAdminHook"}
        ],
        # `airflow config list` shows these; each is read with an empty fallback where it is used.
        "config": {
            "flare_airflow": {
                "description": "flare-airflow's deployment settings (docs/ui.md, docs/tracking.md).",
                "options": {
                    "tracking": _option(
                        "The tracking of every job that leaves `tracking` out (docs/tracking.md): mlflow, "
                        "tensorboard, both comma-separated, or a JSON tracking block.",
                        "mlflow,tensorboard",
                    ),
                    "tracking_uris": _option(
                        "Comma-separated tracking URIs a job file's tracking.uri may name (besides the default's "
                        "own uri); any other is refused at the run's start, and Airflow's metadata database always "
                        "is (docs/tracking.md).",
                        "http://mlflow.internal:5000,postgresql://mlflow-db/mlflow",
                    ),
                    "mlflow_ui_url": _option(
                        "Where people browse the embedded MLflow store (e.g. an `mlflow ui` behind your proxy); "
                        "the Federated runs page links each run there.",
                        "https://mlflow.example.org",
                    ),
                    "store_roots": _option(
                        "Comma-separated model-store URIs the Federated runs page serves files from (default: "
                        "the store under AIRFLOW_HOME); jobs with their own store must be listed (docs/ui.md).",
                        "s3://flare/store",
                    ),
                    "api_url": _option(
                        "The REST API base the Federated runs page calls when the api-server is not reachable on "
                        "the address a request came in on (docs/ui.md).",
                        "http://127.0.0.1:8080",
                    ),
                },
            }
        },
    }


def _option(description: str, example: str) -> dict[str, Any]:
    return {"description": description, "version_added": None, "type": "string", "example": example, "default": None}
