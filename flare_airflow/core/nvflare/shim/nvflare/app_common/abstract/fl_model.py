"""``nvflare.app_common.abstract.fl_model`` under flare-airflow."""

from flare_airflow.core.nvflare.fl_model import FLModel, ParamsType

__all__ = ["FLModel", "ParamsType"]
