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
import contextlib
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag
from airflow.configuration import conf
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from flare_airflow.core.data_ready import SITE_DATA_ASSET, WATCH_SUFFIX
from flare_airflow.core.errors import FlareAirflowError, ReportError
from flare_airflow.core.model import read_record
from flare_airflow.core.page_paths import file_path, segment
from flare_airflow.core.report import read_metrics
from flare_airflow.core.store import ModelStore, run_component
from flare_airflow.operators.common import FAILURE_XCOM_KEY, default_store_uri
from flare_airflow.operators.trust import open_run_xcoms
from flare_airflow.ui import page
from flare_airflow.ui.view import (
    FEDERATED_TAG,
    FINISHED_RUN_STATES,
    RunView,
    build_run_view,
    federated_prefix,
    latest_announcements,
    mark_used_by,
)

log = logging.getLogger(__name__)

CHUNK = 1 << 20
MAX_CONCURRENT_CALLS = 8
FILES = {
    # name -> (publish XCom key, label, media type)
    "model": ("final_model", "final model (safetensors)", "application/octet-stream"),
    "metrics": ("metrics", "metrics.json", "application/json"),
    "plot": ("plot", "metrics.png", "image/png"),
}
COOKIE = "_token"  # Airflow's session cookie (base_auth_manager.COOKIE_NAME_JWT_TOKEN)

app = FastAPI(title="flare-airflow: Federated runs", docs_url=None, redoc_url=None, openapi_url=None)
read_runs = Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.RUN))
# The run page shows XComs, some of them from the page's cache: only to who may read the DAG's XComs.
read_xcoms = Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.XCOM))


def ui_base() -> str:
    """The path Airflow's UI lives under (``[api] base_url``'s path, usually empty)."""
    return urlparse(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")


def store_roots() -> list[ModelStore]:
    """The stores the page may read from: ``[flare_airflow] store_roots`` (comma-separated URIs),
    else the default store under AIRFLOW_HOME. A URI from an XCom outside them is refused."""
    configured = conf.get("flare_airflow", "store_roots", fallback="") or ""
    uris = [u.strip() for u in configured.split(",") if u.strip()] or [default_store_uri()]
    return [ModelStore.from_uri(u) for u in uris]


class AirflowAPI:
    """Airflow's public REST API (``/api/v2``), called as the user who called us."""

    def __init__(self, request: Request) -> None:
        configured = conf.get("flare_airflow", "api_url", fallback="") or ""
        if configured:
            base = configured.rstrip("/")
        else:
            # The socket this request came in on: the same api-server, on loopback here.
            host, port = request.scope["server"]
            host = f"[{host}]" if ":" in host else host
            base = f"{request.url.scheme}://{host}:{port}{ui_base()}"
        header = request.headers.get("authorization")
        if not header and (cookie := request.cookies.get(COOKIE)):
            header = f"Bearer {cookie}"
        self.client = httpx.AsyncClient(base_url=f"{base}/api/v2", headers={"Authorization": header or ""}, timeout=30)
        # A run page reads one XCom per finished task (sites x rounds): a few at a time, so that
        # a large job's page does not flood the api-server that serves it.
        self.slots = asyncio.Semaphore(MAX_CONCURRENT_CALLS)

    async def __aenter__(self) -> AirflowAPI:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def get(self, path: str, missing_ok: bool = False, **params: Any) -> Any:
        async with self.slots:
            r = await self.client.get(path, params=params or None)
        if r.status_code == 404 and missing_ok:
            return None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise HTTPException(r.status_code, f"Airflow API {path}: {detail}")
        return r.json()

    async def task_instances(self, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        while True:
            body = await self.get(
                f"/dags/{segment(dag_id)}/dagRuns/{segment(run_id)}/taskInstances",
                limit=100,
                offset=len(out),
            )
            out.update((ti["task_id"], ti) for ti in body["task_instances"] if ti.get("map_index", -1) == -1)
            if not body["task_instances"] or len(out) >= body["total_entries"]:
                return out

    async def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        path = (
            f"/dags/{segment(dag_id)}/dagRuns/{segment(run_id)}/taskInstances/"
            f"{segment(task_id)}/xcomEntries/{segment(key)}"
        )
        body = await self.get(path, missing_ok=True)
        value = None if body is None else body.get("value")
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = json.loads(value)
        return value


def _final_path(uri: Any, run_id: str, name: str) -> Any:
    """The path of a published output named in the publish task's XCom, if it is where publish
    writes (``<store>/<job>/<run>/final/<name>`` in a configured store); else None."""
    if not isinstance(uri, str):
        return None
    for store in store_roots():
        try:
            path = store.resolve_uri(uri)
        except FlareAirflowError:
            continue
        if path.name == name and path.parent.name == "final" and path.parent.parent.name == run_component(run_id):
            return path
    return None


_NAMES = {"model": "model.safetensors", "metrics": "metrics.json", "plot": "metrics.png"}


def _sha256_of(path: Any) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as fh:
        while piece := fh.read(CHUNK):
            digest.update(piece)
            size += len(piece)
    return digest.hexdigest(), size


def _outputs(run_id: str, published: Any) -> dict[str, Any]:
    """name -> path of the run's published outputs that exist in a configured store."""
    if not isinstance(published, Mapping):
        return {}
    found = {}
    for name, (key, _, _) in FILES.items():
        path = _final_path(published.get(key), run_id, _NAMES[name])
        if path is not None and path.exists():
            found[name] = path
    return found


def _describe(base: str, dag_id: str, run_id: str, outputs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Download links with sha256: the model's from its record (what the store vouches for), the
    others hashed now."""
    out = []
    for name, path in outputs.items():
        if name == "model":
            try:
                record = read_record(path)
            except FlareAirflowError as exc:
                raise HTTPException(500, f"the final model's record is unusable: {exc}") from None
            sha, size, source = record.sha256, path.stat().st_size, "record (model.json)"
        else:
            (sha, size), source = _sha256_of(path), "computed now"
        out.append(
            {
                "name": name,
                "label": FILES[name][1],
                "href": file_path(dag_id, run_id, name, base),
                "sha256": sha,
                "sha256_from": source,
                "size": size,
            }
        )
    return out


def _read_metrics(path: Any) -> dict[str, Any]:
    try:
        return {"rounds": read_metrics(path)}
    except ReportError as exc:
        raise HTTPException(500, str(exc)) from None


@dataclass(frozen=True)
class RunReads:
    """What a run's page reads from Airflow's REST API."""

    run: Mapping[str, Any]
    task_instances: Mapping[str, Mapping[str, Any]]
    xcoms: Mapping[str, Any]  # task id -> its return_value (tasks that have one)
    failures: Mapping[str, str]  # task id -> the reason it left in its XCom ``failure``


class ReadCache:
    """XComs the page has read, so that a render reads only what changed (issue 37 #5).

    A finished task's XCom does not change while the task stays as it finished: its value is kept
    under (dag, run, task, key, try, state, end) -- a retry or a clear changes the key. A finished
    run's reads are kept whole under its REST answer: a render of it reads the run only (a clear
    changes its state). Bounded (least recently used out). Served only behind the routes' checks
    that the caller may read the DAG's runs and XComs, and after the caller read the run itself.
    """

    def __init__(self, runs: int = 64, xcoms: int = 4096) -> None:
        self._runs: OrderedDict[tuple[str, str], RunReads] = OrderedDict()
        self._xcoms: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._sizes = (runs, xcoms)

    @staticmethod
    def _put(store: OrderedDict[Any, Any], key: Any, value: Any, size: int) -> None:
        store[key] = value
        store.move_to_end(key)
        while len(store) > size:
            store.popitem(last=False)

    def finished_run(self, dag_id: str, run_id: str, run: Mapping[str, Any]) -> RunReads | None:
        found = self._runs.get((dag_id, run_id))
        if found is None or found.run != run:
            return None
        self._runs.move_to_end((dag_id, run_id))
        return found

    def keep_run(self, dag_id: str, run_id: str, reads: RunReads) -> None:
        if reads.run.get("state") in FINISHED_RUN_STATES:
            self._put(self._runs, (dag_id, run_id), reads, self._sizes[0])

    async def xcom(self, api: AirflowAPI, dag_id: str, run_id: str, ti: Mapping[str, Any], key: str) -> Any:
        task_id = ti["task_id"]
        if ti.get("state") not in FINISHED_TASK_STATES:
            return await api.xcom(dag_id, run_id, task_id, key=key)
        cache_key = (dag_id, run_id, task_id, key, ti.get("try_number"), ti.get("state"), ti.get("end_date"))
        if cache_key in self._xcoms:
            self._xcoms.move_to_end(cache_key)
            return self._xcoms[cache_key]
        value = await api.xcom(dag_id, run_id, task_id, key=key)
        self._put(self._xcoms, cache_key, value, self._sizes[1])
        return value


CACHE = ReadCache()
FINISHED_TASK_STATES = frozenset({"success", "failed", "upstream_failed", "skipped"})


async def read_run(api: AirflowAPI, dag_id: str, run_id: str, cache: ReadCache = CACHE) -> RunReads:
    """The run, its task instances and their XComs: one call for a finished run read before,
    otherwise the run, its task instances and the XComs not read yet."""
    run = await api.get(f"/dags/{segment(dag_id)}/dagRuns/{segment(run_id)}")
    if (kept := cache.finished_run(dag_id, run_id, run)) is not None:
        return kept
    tis = await api.task_instances(dag_id, run_id)
    prefix = federated_prefix(list(tis))
    wanted = [t for t, ti in tis.items() if ti.get("state") in ("success", "failed") or t == prefix + "prepare"]
    failed = [t for t, ti in tis.items() if ti.get("state") in ("failed", "up_for_retry")]
    values = await asyncio.gather(
        *(cache.xcom(api, dag_id, run_id, tis[t], "return_value") for t in wanted),
        *(cache.xcom(api, dag_id, run_id, tis[t], FAILURE_XCOM_KEY) for t in failed),
    )
    reads = RunReads(
        run=run,
        task_instances=tis,
        xcoms={t: v for t, v in zip(wanted, values[: len(wanted)], strict=True) if v is not None},
        failures={t: str(v) for t, v in zip(failed, values[len(wanted) :], strict=True) if v},
    )
    cache.keep_run(dag_id, run_id, reads)
    return reads


async def _run_data(request: Request, dag_id: str, run_id: str) -> tuple[RunView, list[dict[str, Any]]]:
    async with AirflowAPI(request) as api:
        reads = await read_run(api, dag_id, run_id)
    prefix = federated_prefix(list(reads.task_instances))
    outputs = await run_in_threadpool(_outputs, run_id, reads.xcoms.get(prefix + "publish"))
    metrics = await run_in_threadpool(_read_metrics, outputs["metrics"]) if "metrics" in outputs else None
    mlflow_ui = (conf.get("flare_airflow", "mlflow_ui_url", fallback="") or "").strip() or None
    # Strict mode: the sites' reports and the rounds' per-site metrics are sealed to the central box
    # key in XCom; this page runs on the central API server, which opens them (sites cannot).
    xcoms, unopened = await run_in_threadpool(open_run_xcoms, reads.xcoms, prefix=prefix, run_id=run_id)
    for problem in unopened:
        log.warning("runs page: %s/%s: %s", dag_id, run_id, problem)
    view = build_run_view(dag_id, reads.run, reads.task_instances, xcoms, metrics, reads.failures, mlflow_ui)
    downloads = await run_in_threadpool(_describe, ui_base(), dag_id, run_id, outputs)
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


def _chunks(path: Any) -> Iterator[bytes]:
    with path.open("rb") as fh:
        while piece := fh.read(CHUNK):
            yield piece


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
    outputs = await run_in_threadpool(_outputs, run_id, published)
    if name not in outputs:
        raise HTTPException(404, f"run {run_id} of {dag_id} has no published {FILES[name][1]} (did publish succeed?)")
    path = outputs[name]
    headers = {"Content-Disposition": f'attachment; filename="{run_component(run_id)}-{_NAMES[name]}"'}
    if name == "model":
        headers["X-Flare-Sha256"] = (await run_in_threadpool(read_record, path)).sha256

    async def body() -> AsyncIterator[bytes]:
        async for piece in iterate_in_threadpool(_chunks(path)):
            yield piece

    return StreamingResponse(body(), media_type=FILES[name][2], headers=headers)
