"""What Airflow's components load once so that the task processes they fork start with it.

``$AIRFLOW_HOME/config/airflow_local_settings.py`` imports this module (docs/scale.md): Airflow
imports that file at the start of every component, and LocalExecutor (and Edge / Celery) workers
fork each task process from a process that has already run it. Without it every task process pays
again, per task:

- importing the provider (operators, the job schema, numpy) for its re-parse of the DAG file,
  ~0.25 CPU-s;
- Airflow's object-storage registry, built at a process's first use of any ``ObjectStoragePath``
  (a ``file://`` model store included): it imports every installed provider's filesystem module,
  the Amazon provider's with botocore, 0.1-0.25 s in every prepare, FedAvg and publish task;
- when the deployment tracks with MLflow by default (``[flare_airflow] tracking``), MLflow and its
  SQL store, ~2.4 CPU-s in every prepare, aggregation and publish task (docs/tracking.md).
"""

from __future__ import annotations

from airflow.sdk.io import has_fs

import flare_airflow.builder  # noqa: F401  -- the DAG re-parse's imports

has_fs("file")  # builds (and caches) Airflow's registry of object-storage filesystems


def _preload_tracking() -> None:
    from flare_airflow.core.errors import ConfigError
    from flare_airflow.operators.tracking_target import deployment_default

    try:
        default = deployment_default()
    except ConfigError:
        return  # the DAG files' parse reports the setting's error, where the admin reads it
    if default is not None and default.mlflow:
        from flare_airflow.tracking import preload_mlflow

        preload_mlflow()


_preload_tracking()
