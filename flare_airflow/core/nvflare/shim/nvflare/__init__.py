"""flare-airflow's stand-in for the ``nvflare`` package (see ``flare_airflow.core.nvflare``).

Only the Client API and the constants its scripts import live here. When a real ``nvflare`` is
installed further down the path, its other modules stay importable: each package of this
stand-in extends its ``__path__`` with the real one's directory (``pkgutil.extend_path``), and
the stand-in's own modules come first.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
__version__ = "2.9.0"  # the NVFlare release whose Client API this stand-in follows
FLARE_AIRFLOW_SHIM = True
