"""The flare-airflow Airflow plugin: the Federated runs page (entry point ``airflow.plugins``).

Airflow loads every plugin in every process, task processes included (for their macros), so this
module stays light: the FastAPI app (FastAPI, Airflow's API security, the store) is imported only
when the api-server first routes a request to it.
"""

from __future__ import annotations

from typing import Any

from airflow.plugins_manager import AirflowPlugin

from flare_airflow.core.page_paths import PREFIX


class FederatedRunsApp:
    """An ASGI app that imports :data:`flare_airflow.ui.api.app` on the first request it gets."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from flare_airflow.ui.api import app

        await app(scope, receive, send)


class FlareAirflowPlugin(AirflowPlugin):
    """A FastAPI app mounted by the api-server at ``/flare`` and a nav entry showing it in the UI."""

    name = "flare_airflow"
    fastapi_apps = [{"app": FederatedRunsApp(), "url_prefix": PREFIX, "name": "Federated runs"}]
    external_views = [
        {
            "name": "Federated runs",
            "href": f"{PREFIX}/",
            "destination": "nav",
            "category": "browse",
            "url_route": "federated-runs",
        },
        {
            # A tab on each run's page in Airflow (Airflow fills in the ids). Ids in the query: the
            # UI encodes them with encodeURIComponent, which leaves a "." that a path would lose.
            "name": "Federated run",
            "href": f"{PREFIX}/run?dag_id={{DAG_ID}}&run_id={{RUN_ID}}",
            "destination": "dag_run",
            "url_route": "federated-run",
        },
    ]
