"""``import nvflare.client as flare`` under flare-airflow: see ``flare_airflow.core.nvflare.client``."""

from flare_airflow.core.nvflare.client import *  # noqa: F403
from flare_airflow.core.nvflare.client import __all__  # noqa: F401
