"""The run's own tasks, by the names DAG authors import them under.

Each lives in the module of its concern: ``prepare`` in :mod:`~flare_airflow.operators.prepare`
(who trains: :mod:`~flare_airflow.operators.participants`), ``publish`` in
:mod:`~flare_airflow.operators.publish` (its plot: :mod:`~flare_airflow.operators.plots`), the
verdict in :mod:`~flare_airflow.operators.verdict`, the pod sweep in
:mod:`~flare_airflow.operators.pod_sweep`.
"""

from __future__ import annotations

from flare_airflow.operators.pod_sweep import SweepPodsOperator
from flare_airflow.operators.prepare import PrepareRunOperator
from flare_airflow.operators.publish import PublishOperator, final_model_asset
from flare_airflow.operators.verdict import RunVerdictOperator

__all__ = ["PrepareRunOperator", "PublishOperator", "RunVerdictOperator", "SweepPodsOperator", "final_model_asset"]
