"""The ``flare-airflow`` command and its back-ends.

- :mod:`.commands`: the argument parser and one function per sub-command; ``console`` is the
  console script's entry point (``flare_airflow.cli:console``).
- :mod:`.dag_runs`: Airflow's ``airflow dags test`` in this process, and every task instance's
  final state read back from the metadata database (``run``).
- :mod:`.resume`: continue a failed run from its first incomplete round (``resume``).
- :mod:`.try_trainer`: run a job's trainer by hand as one site's task would (``try-trainer``;
  no Airflow import).
"""

from __future__ import annotations

from flare_airflow.cli.commands import console, main

__all__ = ["console", "main"]
