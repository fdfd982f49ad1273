"""The API server's check of what a site may ask (an ASGI middleware, installed by
:mod:`flare_airflow.edge.plugin` on Airflow's root app).

edge3 proves a worker token's signature but sees only the path: it serves whatever queues a fetch
body names and lets any worker push state or logs for any job. This middleware reads what edge3
reads -- the token, the body, the job's row -- and applies :mod:`flare_airflow.core.trust.control`:

- ``/edge_worker/v1/...``: the token is verified against the registry and bound to its site; a
  worker registers, heartbeats and fetches only under its own name and for a non-empty set of its
  own queues, and pushes state and logs only for jobs it took.
- ``/execution/variables/...`` and ``/execution/connections/...``: a site task (its task instance
  is on a site's queue) resolves only what the registry grants its site -- by default nothing
  central. Airflow still authenticates the token afterwards.

Active only where a registry is configured (``[flare] site_keys``: strict mode); the one-machine
default passes everything through. Airflow imports plugins in every process, so this module
imports nothing heavy at load time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

WORKER_PREFIX = "/edge_worker/v1/"
SECRET_PREFIXES = {"/execution/variables/": "variable", "/execution/connections/": "connection"}
# Bodies whose queues decide: registration, heartbeat, queue changes and fetches -- all small.
MAX_BODY = 1 << 20
_BODY_CALLS = ("worker/", "jobs/fetch/")

_cache: dict[str, Any] = {}


def _registry_path() -> str | None:
    from flare_airflow.operators.trust import trust_settings

    return trust_settings().registry_path


def _trust(path: str) -> tuple[Any, Any]:
    """(Registry, Grants) of the registry file, read again when it changes: a revocation or a new
    grant holds from the next request, without restarting the API server."""
    from flare_airflow.core.trust.grants import read_registry

    stamp = (path, os.stat(path).st_mtime_ns)
    if _cache.get("stamp") != stamp:
        registry, grants = read_registry(Path(path))
        _cache.update(stamp=stamp, registry=registry, grants=grants)
    return _cache["registry"], _cache["grants"]


def _job_owner(key: tuple[str, str, str, int, int]) -> str | None:
    from airflow.providers.edge3.models.edge_job import EdgeJobModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    dag_id, task_id, run_id, try_number, map_index = key
    with create_session() as session:
        return session.scalar(
            select(EdgeJobModel.edge_worker).where(
                EdgeJobModel.dag_id == dag_id,
                EdgeJobModel.task_id == task_id,
                EdgeJobModel.run_id == run_id,
                EdgeJobModel.try_number == try_number,
                EdgeJobModel.map_index == map_index,
            )
        )


def _task_queue(ti_id: str) -> tuple[str, str] | None:
    """(queue, executor) of the task instance ``ti_id``, or None when there is none."""
    import uuid

    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    try:
        uuid.UUID(ti_id)
    except ValueError:
        return None
    with create_session() as session:
        row = session.execute(select(TaskInstance.queue, TaskInstance.executor).where(TaskInstance.id == ti_id)).first()
    return (str(row[0] or ""), str(row[1] or "")) if row else None


def _bearer(scope: Scope) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return str(value.decode("latin-1")).removeprefix("Bearer ").strip()
    return ""


async def _refuse(send: Send, reason: str) -> None:
    body = json.dumps({"detail": f"flare-airflow refused: {reason}"}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 403,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class SiteGuard:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        full = scope.get("path", "") if scope.get("type") == "http" else ""
        # Behind a base path (``[api] base_url`` with a path) the prefixes come later; edge3 itself
        # finds its prefix anywhere in the path, so must the guard, or it would fail open.
        at = {prefix: full.find(prefix) for prefix in (WORKER_PREFIX, *SECRET_PREFIXES)}
        found = [(i, prefix) for prefix, i in at.items() if i >= 0]
        if not found:
            return await self.app(scope, receive, send)
        start, prefix = min(found)
        path = full[start:]
        kind = SECRET_PREFIXES.get(prefix)
        registry_path = _registry_path()
        if registry_path is None:
            return await self.app(scope, receive, send)
        from anyio import to_thread

        from flare_airflow.core.trust import TrustError

        try:
            registry, grants = await to_thread.run_sync(_trust, registry_path)
            if kind is not None:
                await self._check_secret(scope, kind, unquote(path.split("/", 3)[3]), grants)
            else:
                receive = await self._check_worker(scope, receive, path[len(WORKER_PREFIX) :], registry, grants)
        except TrustError as exc:
            log.warning("flare-airflow refused %s %s: %s", scope.get("method"), path, exc)
            return await _refuse(send, str(exc))
        except (OSError, ValueError) as exc:  # fail closed: an unreadable registry refuses every site request
            log.error("flare-airflow refused %s %s: the registry %s: %s", scope.get("method"), path, registry_path, exc)
            return await _refuse(send, f"the API server cannot read its key registry ({exc}); ask the central admin")
        return await self.app(scope, receive, send)

    async def _check_worker(self, scope: Scope, receive: Receive, method: str, registry: Any, grants: Any) -> Receive:
        from anyio import to_thread

        from flare_airflow.core.trust.control import Refused, check_worker_call
        from flare_airflow.core.trust.tokens import verify_worker_token

        if method == "health":
            return receive
        claims = verify_worker_token(_bearer(scope), registry)
        body: dict[str, Any] | None = None
        if method.startswith(_BODY_CALLS):
            raw, receive = await _read_body(receive)
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                raise Refused(f"{method}: the body is not JSON") from None
            if not isinstance(body, dict):
                raise Refused(f"{method}: the body is not a JSON object")
        verb = str(scope.get("method"))
        await to_thread.run_sync(lambda: check_worker_call(verb, method, body, claims, grants, _job_owner))
        return receive

    async def _check_secret(self, scope: Scope, kind: str, name: str, grants: Any) -> None:
        from anyio import to_thread

        from flare_airflow.core.trust.control import Refused, check_secret_request
        from flare_airflow.core.trust.keys import b64url_decode

        try:
            ti_id = str(json.loads(b64url_decode(_bearer(scope).split(".")[1]))["sub"])
        except (ValueError, KeyError, IndexError, TypeError):
            # Airflow would refuse it too; saying so here keeps the rule fail-closed on its own.
            raise Refused(f"a request for {kind} {name!r} carries no task token") from None
        found = await to_thread.run_sync(_task_queue, ti_id)
        if found is None:
            raise Refused(f"a request for {kind} {name!r} names no task instance the API server knows")
        queue, executor = found
        site = grants.site_of_queue(queue)
        if site is None and "EdgeExecutor" in executor:
            # An Edge task on a queue no site is granted: nobody may vouch for it.
            raise Refused(f"a task on queue {queue!r} (EdgeExecutor, no site's grant) may not resolve {kind} {name!r}")
        check_secret_request(kind, name, site, grants)


async def _read_body(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a ``receive`` that hands it to the app as if unread."""
    from flare_airflow.core.trust.control import Refused

    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY:
            raise Refused(f"a worker API body over {MAX_BODY} bytes")
        if not message.get("more_body"):
            break
    raw = b"".join(chunks)
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return raw, replay
