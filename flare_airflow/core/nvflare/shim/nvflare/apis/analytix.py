"""``nvflare.apis.analytix`` under flare-airflow."""

from flare_airflow.core.nvflare.client import AnalyticsDataType

__all__ = ["AnalyticsDataType"]
