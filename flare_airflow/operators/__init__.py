"""Airflow adapters: operators for site jobs, aggregation and run bookkeeping."""
