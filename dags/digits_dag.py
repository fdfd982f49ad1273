"""The demo federated DAG: ``dags/digits.yaml`` as an Airflow DAG (``flare_digits``)."""

from pathlib import Path

from flare_airflow.builder import build_dag

dag = build_dag(Path(__file__).with_name("digits.yaml"))
