"""``nvflare.apis.fl_constant`` under flare-airflow: the names Client API scripts use."""

from flare_airflow.core.nvflare.fl_model import FLMetaKey

__all__ = ["FLMetaKey"]
