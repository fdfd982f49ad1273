"""The Airflow connection to a FLARE deployment's admin API (NVFlare-native mode).

A connection of type ``nvflare`` (any type works; the fields are what count):

* ``login``: the admin user, e.g. ``admin@nvidia.com`` (FLARE takes the identity from the kit's
  certificate; the name is still sent);
* ``extra.startup_kit``: the folder of that user's provisioned admin startup kit on the worker and
  the triggerer (its ``startup/fed_admin.json`` names the server; its key is the credential);
* ``extra.python``: the interpreter of an environment with ``nvflare`` (>= 2.9) installed, which
  runs the admin bridge (flare-airflow's own environment never imports nvflare);
* ``extra.connect_timeout`` (optional): seconds to establish a session (default 10).

The DAG names only the connection id: the kit's location and the user are deployment settings
(an environment variable ``AIRFLOW_CONN_<ID>``, a secrets backend or the UI), never DAG code.
"""

from __future__ import annotations

from typing import Any

from flare_airflow.nvflare_native.admin import FlareAdmin
from flare_airflow.nvflare_native.errors import FlareCredentialError

DEFAULT_CONN_ID = "flare_admin_default"


class FlareAdminHook:
    """Builds a :class:`FlareAdmin` from the Airflow connection ``flare_conn_id``.

    :param flare_conn_id: the connection holding the admin user, the startup kit and the interpreter.
    """

    conn_name_attr = "flare_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "nvflare"
    hook_name = "NVIDIA FLARE admin"

    def __init__(self, flare_conn_id: str = DEFAULT_CONN_ID) -> None:
        self.flare_conn_id = flare_conn_id

    def admin(self) -> FlareAdmin:
        """Read the connection through the Task SDK (a worker or the triggerer)."""
        from airflow.sdk import Connection

        try:
            conn: Any = Connection.get(self.flare_conn_id)
        except Exception as exc:  # the SDK raises its own not-found type; say which connection and how to add it
            raise FlareCredentialError(
                f"the Airflow connection {self.flare_conn_id!r} for the FLARE admin API cannot be read ({exc}): "
                f"add it (AIRFLOW_CONN_{self.flare_conn_id.upper()}, a secrets backend or the UI) with login = the "
                "admin user and extra {'startup_kit': KIT_DIR, 'python': NVFLARE_PYTHON}"
            ) from None
        extra = conn.extra_dejson or {}
        missing = [key for key in ("startup_kit", "python") if not extra.get(key)]
        if missing:
            raise FlareCredentialError(
                f"the Airflow connection {self.flare_conn_id!r} has no extra {' and no extra '.join(missing)}: "
                "startup_kit is the admin user's provisioned kit folder, python the interpreter of an "
                "environment with nvflare installed"
            )
        return FlareAdmin(
            python=str(extra["python"]),
            startup_kit=str(extra["startup_kit"]),
            username=str(conn.login or "admin@nvidia.com"),
            connect_timeout=float(extra.get("connect_timeout", 10.0)),
        )
