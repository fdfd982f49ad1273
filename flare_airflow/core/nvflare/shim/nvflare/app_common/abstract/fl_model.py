"""``nvflare.app_common.abstract.fl_model`` under flare-airflow."""

from flare_airflow.core.nvflare.client import FLModel, ParamsType

__all__ = ["FLModel", "ParamsType"]
