"""flare-airflow's stand-in for the ``nvflare`` package (see ``flare_airflow.core.nvflare``).

``nvflare.client`` is always the stand-in's: NVFlare's own talks to a FLARE client process that
does not exist under flare-airflow. Everything else comes from a real ``nvflare`` when one is
installed further down the path (this package's ``__path__`` is extended with its directory, and
the subpackages put its directories before their own); the stand-in's constant modules are the
fallback where nvflare is not installed.
"""

import importlib
from pkgutil import extend_path
from typing import Any

__path__ = extend_path(__path__, __name__)
REAL_NVFLARE = len(__path__) > 1
FLARE_AIRFLOW_SHIM = True
# A real nvflare's top-level names, imported when first used (as `from nvflare import FedJob`).
_REAL_NAMES = {
    "FedJob": "nvflare.job_config.api",
    "FilterType": "nvflare.job_config.defs",
    "SimulatorRunner": "nvflare.private.fed.app.simulator.simulator_runner",
}

# A real nvflare's version, or the NVFlare release whose Client API this stand-in follows.
__version__ = importlib.import_module("nvflare._version").get_versions()["version"] if REAL_NVFLARE else "2.9.0"


def __getattr__(name: str) -> Any:
    if REAL_NVFLARE and name in _REAL_NAMES:
        return getattr(importlib.import_module(_REAL_NAMES[name]), name)
    raise AttributeError(f"module 'nvflare' (flare-airflow's stand-in) has no attribute {name!r}")
