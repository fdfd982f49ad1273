"""``import nvflare.client as flare`` under flare-airflow: see ``flare_airflow.core.nvflare.client``.

With a real nvflare installed, ``FLModel``, ``ParamsType`` and ``AnalyticsDataType`` are its own
classes (``receive()`` returns its ``FLModel``), so that a script mixing ``nvflare.client`` with
``nvflare.app_common.abstract.fl_model`` sees one class.
"""

import importlib
from pkgutil import extend_path

from flare_airflow.core.nvflare.client import *  # noqa: F403
from flare_airflow.core.nvflare.client import __all__, use_model_classes  # noqa: F401

# The API is the stand-in's; a real nvflare's other client modules (config, utils) stay importable.
__path__ = extend_path(__path__, __name__)  # noqa: F405 - the package's own __path__

# The real package's modules when nvflare is installed, else the stand-in's (the classes above).
# (They replace the star-imported classes on purpose: hence the type: ignore.)
AnalyticsDataType = importlib.import_module("nvflare.apis.analytix").AnalyticsDataType  # type: ignore[misc]
FLModel = importlib.import_module("nvflare.app_common.abstract.fl_model").FLModel  # type: ignore[misc]
ParamsType = importlib.import_module("nvflare.app_common.abstract.fl_model").ParamsType  # type: ignore[misc]
use_model_classes(FLModel, ParamsType)
