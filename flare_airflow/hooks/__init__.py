"""Airflow-facing helpers that own a connection or the metadata database (pools)."""
