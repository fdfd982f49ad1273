"""Native mode's typed errors: one base, one type per thing an operator does something different about."""

from __future__ import annotations


class FlareAdminError(RuntimeError):
    """Talking to a FLARE deployment failed (the message says what, where and what to do)."""


class FlareCredentialError(FlareAdminError):
    """The admin credentials (startup kit, NVFlare interpreter) are missing, wrong or refused: retrying
    cannot help."""


class FlareConnectionError(FlareAdminError):
    """The FLARE server could not be reached or did not answer in time: a retry may help."""


class FlareNotReadyError(FlareAdminError):
    """The expected FLARE clients were not connected before the readiness timeout."""


class FlareJobError(FlareAdminError):
    """FLARE refused the job or does not know it (a bad job folder, a changed folder under one token)."""


class FlareResultError(FlareAdminError):
    """The finished job's result holds no global model flare-airflow can read safely."""
