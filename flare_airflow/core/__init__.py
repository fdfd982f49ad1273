"""Core layer: pure Python + numpy. Never imports Airflow."""
