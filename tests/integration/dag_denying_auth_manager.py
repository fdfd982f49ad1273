"""TEST-ONLY auth manager: Airflow's SimpleAuthManager plus per-DAG denials.

SimpleAuthManager's permissions are roles (viewer, user, op, admin) over *all* DAGs: it cannot
say "this user may not read that DAG", so with it no user can get a 403 on one DAG while reading
another. Real deployments say that with an auth manager that has per-DAG permissions (FAB,
Keycloak). This subclass denies the (user, dag_id) pairs listed in ``FLARE_TEST_DENIED_DAGS``
(``user:dag_id,...``) and defers everything else to SimpleAuthManager, so the test shows that the
plugin's endpoints ask the auth manager about the right DAG and answer 403 when it says no.
"""

from __future__ import annotations

import os
from typing import Any

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager


def _denied() -> set[tuple[str, str]]:
    pairs = (item.split(":", 1) for item in os.environ.get("FLARE_TEST_DENIED_DAGS", "").split(",") if ":" in item)
    return {(user, dag) for user, dag in pairs}


class DagDenyingAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        if details is not None and details.id and (user.get_name(), details.id) in _denied():
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
