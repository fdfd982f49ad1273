"""``nvflare.apis.analytix`` under flare-airflow."""

from flare_airflow.core.nvflare.fl_model import AnalyticsDataType

__all__ = ["AnalyticsDataType"]
