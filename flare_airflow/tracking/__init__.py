"""Experiment tracking writers: the run's own tasks log its numbers to MLflow and TensorBoard files.

No Airflow import here (the Airflow side, connections and task context, is
:mod:`flare_airflow.operators.tracking`); the tracker's client is imported only when a job
tracks. What is logged, as plain data, is :mod:`flare_airflow.core.tracking`.
"""

from flare_airflow.tracking.mlflow_writer import MlflowWriter, RunIdentity, TrackingError, preload_mlflow
from flare_airflow.tracking.tensorboard_writer import TensorBoardWriter

__all__ = ["MlflowWriter", "RunIdentity", "TensorBoardWriter", "TrackingError", "preload_mlflow"]
