"""Part of flare-airflow's ``nvflare`` stand-in: a real nvflare's modules first, the stand-in's as fallback."""

import os
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
_HERE = os.path.dirname(__file__)
__path__[:] = [p for p in __path__ if os.path.realpath(p) != os.path.realpath(_HERE)] + [_HERE]
