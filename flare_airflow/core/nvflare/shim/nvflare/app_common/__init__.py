"""Part of flare-airflow's ``nvflare`` stand-in; a real nvflare's modules here stay importable."""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
