"""NVFlare-native mode without Airflow: drive a running FLARE deployment through its admin API.

``bridge`` is the program that runs where ``nvflare`` is installed; ``admin`` calls it; ``states``
maps FLARE's job statuses; ``result`` reads the finished job's global model. The Airflow side
(hook, operator, trigger) lives in ``flare_airflow.hooks`` / ``operators`` / ``triggers``.
"""
