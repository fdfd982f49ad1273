"""The Airflow plugin that puts :class:`~flare_airflow.edge.middleware.SiteGuard` on the API
server's root app (``fastapi_root_middlewares``). It does nothing until ``[flare] site_keys``
names a registry; Airflow loads plugins in every process, so this stays light."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from flare_airflow.edge.middleware import SiteGuard


class FlareEdgePlugin(AirflowPlugin):
    name = "flare_airflow_edge"
    fastapi_root_middlewares = [{"middleware": SiteGuard, "args": [], "kwargs": {}, "name": "flare-airflow site guard"}]
