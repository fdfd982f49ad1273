"""Paths of the Federated runs page (pure Python: the publish task, the page and the plugin share them).

A path segment of a call to Airflow's REST API is percent-encoded completely, ``.`` included: a DAG
or run id ``..`` left as it is would be resolved as "the parent directory" by the HTTP client (RFC
3986 dot segments), so the page would ask Airflow's API for another path than the one meant. The
page's own URLs carry ids in the query (see :func:`run_page_path`).
"""

from __future__ import annotations

from urllib.parse import quote, urlencode

PREFIX = "/flare"


def segment(value: str) -> str:
    """One URL path segment holding ``value`` exactly (``/``, ``.``, ``%``, ``?``, ``#`` encoded)."""
    return quote(str(value), safe="").replace(".", "%2E")


def run_page_path(dag_id: str, run_id: str, ui_base: str = "") -> str:
    """The Federated run page of one run, under Airflow's ``[api] base_url`` path ``ui_base``.

    The ids go in the query, not the path: browsers treat a path segment ``..`` -- also written
    ``%2E%2E`` -- as "the parent directory" (WHATWG URL), a query value they leave alone.
    """
    return f"{ui_base}{PREFIX}/run?{urlencode({'dag_id': dag_id, 'run_id': run_id})}"


def dag_page_path(dag_id: str, ui_base: str = "") -> str:
    """The Federated runs page of one DAG (ids in the query, as in :func:`run_page_path`)."""
    return f"{ui_base}{PREFIX}/dag?{urlencode({'dag_id': dag_id})}"


def file_path(dag_id: str, run_id: str, name: str, ui_base: str = "") -> str:
    """A published output of a run, streamed by the page's API."""
    return f"{ui_base}{PREFIX}/api/file?{urlencode({'dag_id': dag_id, 'run_id': run_id, 'name': name})}"
