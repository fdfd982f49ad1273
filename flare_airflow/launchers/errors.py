"""The launcher layer's error: a site job could not be launched."""

from __future__ import annotations

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.spec import JobReturnCode


class LaunchError(FlareAirflowError, RuntimeError):
    """The site job could not be started (missing executable, bad cwd, a pod refused by site policy, ...).

    ``return_code``: CONFIG_ERROR (what the site asked for cannot run) unless the backend knows
    better -- an image that cannot be pulled is an INFRASTRUCTURE_ERROR.
    """

    def __init__(self, message: str, return_code: JobReturnCode = JobReturnCode.CONFIG_ERROR) -> None:
        super().__init__(message)
        self.return_code = return_code
