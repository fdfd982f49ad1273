"""``nvflare.client.tracking`` under flare-airflow: see ``flare_airflow.core.nvflare.tracking``."""

from flare_airflow.core.nvflare.tracking import *  # noqa: F403
from flare_airflow.core.nvflare.tracking import __all__  # noqa: F401
