"""Short import path for trainer scripts: ``import flare_airflow.client as flare``."""

from flare_airflow.core.client import *  # noqa: F403
from flare_airflow.core.client import __all__  # noqa: F401
