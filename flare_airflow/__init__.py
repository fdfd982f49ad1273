"""flare-airflow: federated learning on Apache Airflow 3.

The top-level package imports nothing heavy, so the Client API (``flare_airflow.core.client``)
works in a site image where Airflow is not installed.
"""

__version__ = "0.1.0"
