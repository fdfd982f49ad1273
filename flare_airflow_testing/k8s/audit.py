"""Count API requests from the kube-apiserver audit log (JSON lines, level Metadata, see control_plane.py).

Each request is one audit ID; watches and log streams have a ``ResponseStarted`` and a
``ResponseComplete`` event, other requests only ``ResponseComplete`` (``RequestReceived`` is omitted
by the policy). The apiserver writes an event after the response, so call :meth:`AuditLog.settle`
before counting what a client just did.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import time
from collections.abc import Iterable
from typing import Any

from flare_airflow_testing.k8s.control_plane import CONTROL_PLANE_USERS, USERS

NODE_AGENT_USER = USERS["node"][0]
ADMIN_USER = USERS["admin"][0]
APISERVER_USER = "system:apiserver"  # its own admission reads (e.g. LimitRanger)


class AuditLog:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)

    def mark(self) -> int:
        """Current end of the log: pass it as ``since`` to count only what happens afterwards."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def settle(self, quiet: float = 0.5, timeout: float = 5.0) -> None:
        """Wait until the log has not grown for ``quiet`` seconds (events land after responses)."""
        deadline = time.monotonic() + timeout
        size, since = self.mark(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.mark()
            if now != size:
                size, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        out = []
        with open(self.path, "rb") as f:
            f.seek(since)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # being written
                out.append(json.loads(line))
        return out

    def requests(
        self,
        *,
        since: int = 0,
        namespace: str | None = None,
        pod: str | None = None,
        users: Iterable[str] | None = None,
        exclude_users: Iterable[str] | None = None,
    ) -> list[dict[str, Any]]:
        """One entry per request (last stage seen), filtered.

        ``pod``: only requests on that pod (``pods`` and its subresources, by name, including its
        create); requests that name no object (lists, watches) match when ``namespace`` matches.
        """
        users_set = set(users) if users is not None else None
        excluded = set(exclude_users or ())
        by_id: dict[str, dict[str, Any]] = {}
        for ev in self.events(since):
            ref = ev.get("objectRef") or {}
            user = (ev.get("user") or {}).get("username", "")
            if users_set is not None and user not in users_set:
                continue
            if user in excluded:
                continue
            if namespace is not None and ref.get("namespace") != namespace:
                continue
            if pod is not None and ref.get("name") and not (ref.get("resource") == "pods" and ref.get("name") == pod):
                continue
            by_id[ev["auditID"]] = ev
        return list(by_id.values())

    def client_requests(self, namespace: str, *, since: int = 0, pod: str | None = None) -> list[dict[str, Any]]:
        """Requests in ``namespace`` made by clients: not the apiserver, scheduler, controller-manager or node agent."""
        return self.requests(
            since=since,
            namespace=namespace,
            pod=pod,
            exclude_users=CONTROL_PLANE_USERS | {NODE_AGENT_USER, APISERVER_USER},
        )

    def list_watch_requests(self, namespace: str, since: int) -> list[str]:
        """The clients' list and watch requests in ``namespace`` since ``since``, once the log has settled:
        what a pod watch costs the apiserver."""
        self.settle()
        return [
            describe(ev) for ev in self.client_requests(namespace, since=since) if ev.get("verb") in ("list", "watch")
        ]


def describe(ev: dict[str, Any]) -> str:
    ref = ev.get("objectRef") or {}
    resource = ref.get("resource", ev.get("requestURI", "?"))
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    return f"{ev.get('verb')} {resource}"


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """``{user: {"verb resource[/subresource]": count}}``."""
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for ev in events:
        table[(ev.get("user") or {}).get("username", "?")][describe(ev)] += 1
    return {user: dict(sorted(c.items())) for user, c in sorted(table.items())}


def format_summary(events: Iterable[dict[str, Any]]) -> str:
    lines = []
    for user, counts in summarize(events).items():
        lines.append(f"{user}: {sum(counts.values())} requests")
        lines.extend(f"    {n:4d}  {what}" for what, n in counts.items())
    return "\n".join(lines)
