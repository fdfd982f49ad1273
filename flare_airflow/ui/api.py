"""The Federated runs FastAPI app, mounted by Airflow's api-server at ``/flare``.

Authentication and authorisation are Airflow's own: every route depends on
``airflow.api_fastapi.core_api.security`` (``get_user`` -> 401 without a valid token or session
cookie; ``requires_access_dag`` -> 403 for a user who may not read the DAG's runs). The data come
from Airflow's public REST API, called on the caller's behalf with the caller's own credential (so
the REST API's own checks apply too), and from the model store; nothing here opens the metadata
database.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from airflow.configuration import conf
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from flare_airflow.core.data_ready import SITE_DATA_ASSET, WATCH_SUFFIX
from flare_airflow.core.model import read_record
from flare_airflow.core.page_paths import segment
from flare_airflow.core.store import run_component
from flare_airflow.operators.trust import open_run_xcoms
from flare_airflow.ui import page
from flare_airflow.ui.files import FILES, chunks, describe_downloads, metrics_of, published_outputs
from flare_airflow.ui.reads import AirflowAPI, read_run, ui_base
from flare_airflow.ui.view import (
    FEDERATED_TAG,
    RunView,
    build_run_view,
    federated_prefix,
    latest_announcements,
    mark_used_by,
)

log = logging.getLogger(__name__)


app = FastAPI(title="flare-airflow: Federated runs", docs_url=None, redoc_url=None, openapi_url=None)
read_runs = Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.RUN))
# The run page shows XComs, some of them from the page's cache: only to who may read the DAG's XComs.
read_xcoms = Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.XCOM))


async def _run_data(request: Request, dag_id: str, run_id: str) -> tuple[RunView, list[dict[str, Any]]]:
    async with AirflowAPI(request) as api:
        reads = await read_run(api, dag_id, run_id)
    prefix = federated_prefix(list(reads.task_instances))
    outputs = await run_in_threadpool(published_outputs, run_id, reads.xcoms.get(prefix + "publish"))
    metrics = await run_in_threadpool(metrics_of, outputs["metrics"]) if "metrics" in outputs else None
    mlflow_ui = (conf.get("flare_airflow", "mlflow_ui_url", fallback="") or "").strip() or None
    # Strict mode: the sites' reports and the rounds' per-site metrics are sealed to the central box
    # key in XCom; this page runs on the central API server, which opens them (sites cannot).
    xcoms, unopened = await run_in_threadpool(open_run_xcoms, reads.xcoms, prefix=prefix, run_id=run_id)
    for problem in unopened:
        log.warning("runs page: %s/%s: %s", dag_id, run_id, problem)
    view = build_run_view(dag_id, reads.run, reads.task_instances, xcoms, metrics, reads.failures, mlflow_ui)
    downloads = await run_in_threadpool(describe_downloads, ui_base(), dag_id, run_id, outputs)
    return view, downloads


# The page's own resources: no inline script or style, so the Content-Security-Policy below can
# forbid both (an XSS in a reason or an id could not run).
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'self'; base-uri 'none'; form-action 'none'"
)


@app.middleware("http")
async def security_headers(request: Request, call_next: Any) -> Response:
    response: Response = await call_next(request)
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Content-Security-Policy"] = CSP
    response.headers.setdefault("Cache-Control", "no-store")
    return response


@app.exception_handler(StarletteHTTPException)
async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Errors as Airflow's API gives them, except an unusable token: 401 with a Bearer challenge
    (Airflow's ``get_user`` answers 403 "Invalid JWT token", which tells a client to stop trying
    instead of to log in again)."""
    status, headers = exc.status_code, dict(exc.headers or {})
    if status == 403 and exc.detail == "Invalid JWT token":
        status = 401
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"detail": exc.detail}, status_code=status, headers=headers)


@app.get("/static/page.css")
async def stylesheet() -> Response:
    return Response(page.STYLE, media_type="text/css", headers={"Cache-Control": "max-age=300"})


@app.get("/static/page.js")
async def script() -> Response:
    return Response(page.SCRIPT, media_type="text/javascript", headers={"Cache-Control": "max-age=300"})


@app.get("/", response_class=HTMLResponse)
async def index(request: Request, user: GetUserDep) -> str:
    """The federated DAGs the user may read, with their latest run."""
    async with AirflowAPI(request) as api:
        dags = (await api.get("/dags", tags=FEDERATED_TAG, limit=100, order_by="dag_id"))["dags"]
        runs = await asyncio.gather(
            *(api.get(f"/dags/{segment(d['dag_id'])}/dagRuns", limit=1, order_by="-run_after") for d in dags)
        )
    for dag, found in zip(dags, runs, strict=True):
        dag["runs"] = found["dag_runs"]
    return page.index_page(ui_base(), dags)


# Each page has two addresses: ids in the path (readable) and ids in the query (what the page
# links to: a path segment ".." is "the parent directory" to a browser, a query value is not).


@app.get("/dags/{dag_id}", response_class=HTMLResponse, dependencies=[read_runs])
@app.get("/dag", response_class=HTMLResponse, dependencies=[read_runs])
async def dag_runs(request: Request, dag_id: str) -> str:
    async with AirflowAPI(request) as api:
        body = await api.get(f"/dags/{segment(dag_id)}/dagRuns", limit=50, order_by="-run_after")
        # The site-data panel is extra: a user who may read the runs but not the DAG's details or
        # the assets still gets the runs.
        try:
            dag = await api.get(f"/dags/{segment(dag_id)}/details", missing_ok=True) or {}
            latest = await _announcements(api, dag_id, dag)
            for run in body["dag_runs"] if latest else ():
                if isinstance(run.get("conf"), Mapping) and run["conf"].get("sites"):  # the watch's or the form's
                    run_id = str(run["dag_run_id"])
                    mark_used_by(latest, await api.xcom(dag_id, run_id, "prepare"), run_id)
            watch = await _watch_decision(api, dag_id) if latest else None
        except HTTPException:
            dag, latest, watch = {}, {}, None
    return page.dag_page(ui_base(), dag_id, body["dag_runs"], latest, str(dag.get("description") or ""), watch)


async def _watch_decision(api: AirflowAPI, dag_id: str) -> str | None:
    """What the job's data watch (wait, cron fallback) decided last, and why; None without a watch."""
    watch_id = dag_id + WATCH_SUFFIX
    runs = await api.get(f"/dags/{segment(watch_id)}/dagRuns", missing_ok=True, limit=5, order_by="-run_after")
    for run in (runs or {}).get("dag_runs", []):
        if run.get("state") == "success":
            decided = await api.xcom(watch_id, str(run["dag_run_id"]), "decide")
            why = decided.get("why") if isinstance(decided, Mapping) else None
            return f"{why} ({run.get('end_date')})" if isinstance(why, str) else None
    return None


async def _announcements(api: AirflowAPI, dag_id: str, dag: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The sites' latest data announcements and the runs of ``dag_id`` that consumed them (only
    for a DAG scheduled on the sites' data)."""
    if SITE_DATA_ASSET not in json.dumps(dag.get("asset_expression") or ""):
        return {}
    assets = await api.get("/assets", name_pattern=SITE_DATA_ASSET, limit=10)
    ids = [a["id"] for a in (assets or {}).get("assets", []) if a.get("name") == SITE_DATA_ASSET]
    if not ids:
        return {}
    events = await api.get("/assets/events", asset_id=ids[0], limit=500, order_by="-timestamp")
    return latest_announcements(list((events or {}).get("asset_events", [])), dag_id)


@app.get("/dags/{dag_id}/runs/{run_id}", response_class=HTMLResponse, dependencies=[read_runs, read_xcoms])
@app.get("/run", response_class=HTMLResponse, dependencies=[read_runs, read_xcoms])
async def run_html(request: Request, dag_id: str, run_id: str, fragment: bool = False) -> str:
    view, downloads = await _run_data(request, dag_id, run_id)
    if fragment:
        return page.run_content(view, ui_base(), downloads)
    return page.run_page(view, ui_base(), downloads)


@app.get("/api/dags/{dag_id}/runs/{run_id}", dependencies=[read_runs, read_xcoms])
@app.get("/api/run", dependencies=[read_runs, read_xcoms])
async def run_json(request: Request, dag_id: str, run_id: str) -> JSONResponse:
    """The page's data as JSON: rounds x sites, the per-round rows, the charts' series, downloads."""
    from dataclasses import asdict

    from flare_airflow.ui.view import charts

    view, downloads = await _run_data(request, dag_id, run_id)
    return JSONResponse(
        {
            **asdict(view),
            "finished": view.finished,
            "charts": [asdict(c) for c in charts(view)],
            "downloads": downloads,
        }
    )


@app.get("/api/dags/{dag_id}/runs/{run_id}/files/{name}", dependencies=[read_runs])
@app.get("/api/file", dependencies=[read_runs])
async def download(request: Request, dag_id: str, run_id: str, name: str) -> StreamingResponse:
    """One published output of the run, streamed from the store (any scheme the store supports)."""
    if name not in FILES:
        raise HTTPException(404, f"no output {name!r}; one of {', '.join(FILES)}")
    async with AirflowAPI(request) as api:
        await api.get(f"/dags/{segment(dag_id)}/dagRuns/{segment(run_id)}")
        prefix = federated_prefix(list(await api.task_instances(dag_id, run_id)))
        published = await api.xcom(dag_id, run_id, prefix + "publish")
    outputs = await run_in_threadpool(published_outputs, run_id, published)
    if name not in outputs:
        raise HTTPException(
            404, f"run {run_id} of {dag_id} has no published {FILES[name].label} (did publish succeed?)"
        )
    path = outputs[name]
    headers = {"Content-Disposition": f'attachment; filename="{run_component(run_id)}-{FILES[name].file_name}"'}
    if name == "model":
        headers["X-Flare-Sha256"] = (await run_in_threadpool(read_record, path)).sha256

    async def body() -> AsyncIterator[bytes]:
        async for piece in iterate_in_threadpool(chunks(path)):
            yield piece

    return StreamingResponse(body(), media_type=FILES[name].media_type, headers=headers)
