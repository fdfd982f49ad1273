"""What Airflow's components load once so that the task processes they fork start with it.

``$AIRFLOW_HOME/config/airflow_local_settings.py`` imports this module (docs/scale.md): Airflow
imports that file at the start of every component, and LocalExecutor (and Edge / Celery) workers
fork each task process from a process that has already run it. Without it every task process pays
again, per task:

- importing the provider (operators, the job schema, numpy) for its re-parse of the DAG file,
  ~0.25 CPU-s;
- Airflow's object-storage registry, built at a process's first use of any ``ObjectStoragePath``
  (a ``file://`` model store included): it imports every installed provider's filesystem module,
  the Amazon provider's with botocore, 0.1-0.25 s in every prepare, FedAvg and publish task.
"""

from __future__ import annotations

from airflow.sdk.io import has_fs

import flare_airflow.builder  # noqa: F401  -- the DAG re-parse's imports

has_fs("file")  # builds (and caches) Airflow's registry of object-storage filesystems
