"""Airflow provider metadata (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    from flare_airflow import __version__
    from flare_airflow.core.backends import BACKENDS

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
                # Each backend's site-task module (the registry's), then the backend-neutral ones.
                "python-modules": [
                    *dict.fromkeys(b.site_task.rpartition(".")[0] for b in BACKENDS.values()),
                    "flare_airflow.operators.site_job",
                    "flare_airflow.operators.aggregate",
                    "flare_airflow.operators.run",
                    "flare_airflow.operators.nvflare_native",
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
                "python-modules": [
                    "flare_airflow.triggers.pod_state",
                    "flare_airflow.triggers.slurm_state",
                    "flare_airflow.triggers.flare_job",
                    "flare_airflow.triggers.container_state",
                ],
            }
        ],
        "hooks": [{"integration-name": "Federated learning", "python-modules": ["flare_airflow.hooks.flare_admin"]}],
        "connection-types": [
            {"connection-type": "nvflare", "hook-class-name": "flare_airflow.hooks.flare_admin.FlareAdminHook"}
        ],
    }
