"""What the Federated runs page reads from Airflow's public REST API, as the user who called it,
and the cache that keeps a render from reading again what cannot have changed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx
from airflow.configuration import conf
from fastapi import HTTPException, Request

from flare_airflow.core.page_paths import segment
from flare_airflow.operators.common import FAILURE_XCOM_KEY
from flare_airflow.ui.view import (
    FINISHED_RUN_STATES,
    federated_prefix,
)

MAX_CONCURRENT_CALLS = 8
COOKIE = "_token"  # Airflow's session cookie (base_auth_manager.COOKIE_NAME_JWT_TOKEN)


def ui_base() -> str:
    """The path Airflow's UI lives under (``[api] base_url``'s path, usually empty)."""
    return urlparse(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")


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
