"""Launchers layer: one module per backend, implementing the launcher spec without Airflow."""
