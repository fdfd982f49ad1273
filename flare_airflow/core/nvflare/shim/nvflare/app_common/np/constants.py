"""``nvflare.app_common.np.constants`` under flare-airflow (NVFlare 2.9's values)."""


class NPConstants:
    NUMPY_KEY = "numpy_key"
