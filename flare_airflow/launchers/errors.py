"""The launcher layer's error: a site job could not be launched."""

from __future__ import annotations

from flare_airflow.core.errors import FlareAirflowError


class LaunchError(FlareAirflowError, RuntimeError):
    """The site job could not be started (missing executable, bad cwd, a pod refused by site policy, ...)."""
