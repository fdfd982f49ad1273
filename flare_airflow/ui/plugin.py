"""The flare-airflow Airflow plugin: the Federated runs page (entry point ``airflow.plugins``)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from flare_airflow.ui.api import PREFIX, app


class FlareAirflowPlugin(AirflowPlugin):
    """A FastAPI app mounted by the api-server at ``/flare`` and a nav entry showing it in the UI."""

    name = "flare_airflow"
    fastapi_apps = [{"app": app, "url_prefix": PREFIX, "name": "Federated runs"}]
    external_views = [
        {
            "name": "Federated runs",
            "href": f"{PREFIX}/",
            "destination": "nav",
            "category": "browse",
            "url_route": "federated-runs",
        }
    ]
