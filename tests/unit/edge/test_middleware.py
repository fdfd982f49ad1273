"""The API server's site guard (flare_airflow/edge/middleware.py) as an ASGI app around a fake
Airflow, and the worker's signing shim (flare_airflow/edge/worker.py): no servers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from flare_airflow.core.trust import TrustError, generate_keys
from flare_airflow.core.trust.keys import load_signing_key, party_dir
from flare_airflow.core.trust.registry import Registry
from flare_airflow.core.trust.tokens import sign_worker_token, verify_worker_token
from flare_airflow.edge import middleware
from flare_airflow.edge.verifier import authorize
from flare_airflow.edge.worker import SiteSigner, edge_worker_argv, resigning, site_grant


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("keys")
    jwks: list[dict[str, Any]] = []
    for party in ("site-1", "site-2", "central"):
        jwks += generate_keys(party, party_dir(root, party), box=party != "central").jwks["keys"]
    registry = root / "registry.json"
    registry.write_text(json.dumps({"keys": jwks}))
    return {"root": root, "registry": registry}


@pytest.fixture
def guard(keys: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The guard around an app that records what reached it; jobs and task instances faked."""
    seen: list[tuple[str, bytes]] = []
    state: dict[str, Any] = {"owner": None, "ti": ("default", "LocalExecutor"), "seen": seen}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive()).get("body", b"")
        seen.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    monkeypatch.setattr(middleware, "_registry_path", lambda: str(keys["registry"]))
    monkeypatch.setattr(middleware, "_job_owner", lambda key: state["owner"])
    monkeypatch.setattr(middleware, "_task_queue", lambda ti: state["ti"])
    state["app"] = middleware.SiteGuard(app)
    return state


def _request(guard: dict[str, Any], verb: str, path: str, token: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    raw = json.dumps(body).encode() if body is not None else b""
    chunks = [raw[: len(raw) // 2], raw[len(raw) // 2 :]]  # a body in two messages
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": verb, "path": path, "headers": [(b"authorization", f"Bearer {token}".encode())]}
    asyncio.run(guard["app"](scope, receive, send))
    body_out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body_out or b"{}")


def _token(keys: dict[str, Any], site: str, method: str, worker: str | None = None) -> str:
    kid, key = load_signing_key(party_dir(keys["root"], site), site)
    return sign_worker_token(key, kid, site=site, worker=worker or f"{site}-worker", method=method)


def test_a_workers_own_fetch_reaches_airflow_with_its_body(keys: dict[str, Any], guard: dict[str, Any]) -> None:
    m = "jobs/fetch/site-1-worker"
    status, _ = _request(guard, "POST", f"/edge_worker/v1/{m}", _token(keys, "site-1", m), {"queues": ["site-1"]})
    assert status == 200
    assert guard["seen"] == [(f"/edge_worker/v1/{m}", json.dumps({"queues": ["site-1"]}).encode())]


@pytest.mark.parametrize(
    ("site", "method", "body", "reason"),
    [
        ("site-2", "jobs/fetch/site-2-worker", {"queues": ["site-1"]}, "may not fetch jobs of queue(s) ['site-1']"),
        ("site-2", "jobs/fetch/site-2-worker", {"queues": None}, "must name its queues"),
        ("site-2", "worker/site-1-worker", {"queues": ["site-1"]}, "may not act as worker 'site-1-worker'"),
    ],
    ids=["other-queue", "no-queue", "other-worker"],
)
def test_a_workers_foreign_call_never_reaches_airflow(
    keys: dict[str, Any], guard: dict[str, Any], site: str, method: str, body: Any, reason: str
) -> None:
    status, out = _request(guard, "POST", f"/edge_worker/v1/{method}", _token(keys, site, method), body)
    assert status == 403 and reason in out["detail"], out
    assert guard["seen"] == []


def test_state_and_logs_only_for_the_callers_jobs(keys: dict[str, Any], guard: dict[str, Any]) -> None:
    m = "jobs/state/d/round_1.site-1/r/1/-1/failed"
    guard["owner"] = "site-1-worker"
    status, out = _request(guard, "PATCH", f"/edge_worker/v1/{m}", _token(keys, "site-2", m))
    assert status == 403 and "worker 'site-1-worker' took it" in out["detail"]
    assert _request(guard, "PATCH", f"/edge_worker/v1/{m}", _token(keys, "site-1", m))[0] == 200


def test_a_token_not_from_a_site_key_is_refused(keys: dict[str, Any], guard: dict[str, Any]) -> None:
    m = "jobs/fetch/site-1-worker"
    status, out = _request(guard, "POST", f"/edge_worker/v1/{m}", "eyJhbGciOiJIUzUxMiJ9.e30.eA", {"queues": ["site-1"]})
    assert status == 403 and "EdDSA" in out["detail"]
    status, out = _request(guard, "POST", f"/edge_worker/v1/{m}", "", {"queues": ["site-1"]})
    assert status == 403 and "compact JWS" in out["detail"]


def _ti_token(ti_id: str) -> str:
    import base64

    claims = base64.urlsafe_b64encode(json.dumps({"sub": ti_id}).encode()).rstrip(b"=").decode()
    return f"eyJhbGciOiJFZERTQSJ9.{claims}.sig"


def test_site_tasks_are_refused_central_secrets_and_central_tasks_are_not(guard: dict[str, Any]) -> None:
    guard["ti"] = ("site-2", "EdgeExecutor")
    for path, what in (
        ("/execution/variables/flare_central_noise_secret", "variable 'flare_central_noise_secret'"),
        ("/execution/connections/flare_store", "connection 'flare_store'"),
    ):
        status, out = _request(guard, "GET", path, _ti_token("0193"))
        assert status == 403 and f"a task of site 'site-2' may not resolve the central {what}" in out["detail"], out
    guard["ti"] = ("mystery", "airflow.providers.edge3.executors.EdgeExecutor")  # no site's queue: fail closed
    assert _request(guard, "GET", "/execution/variables/x", _ti_token("0193"))[0] == 403
    guard["ti"] = None  # no such task instance
    assert _request(guard, "GET", "/execution/variables/x", _ti_token("0193"))[0] == 403
    assert _request(guard, "GET", "/execution/variables/x", "not-a-token")[0] == 403
    guard["ti"] = ("default", "LocalExecutor")  # the central aggregation
    assert _request(guard, "GET", "/execution/variables/flare_central_noise_secret", _ti_token("0194"))[0] == 200


def test_without_a_registry_everything_passes(guard: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(middleware, "_registry_path", lambda: None)
    assert _request(guard, "POST", "/edge_worker/v1/jobs/fetch/x", "", {"queues": None})[0] == 200


def test_edge3_verifier_accepts_only_site_worker_tokens() -> None:
    ok = {"iss": "flare-airflow-site", "flare_site": "site-1", "sub": "site-1-worker"}
    assert authorize(ok, None) == {"authorized": True}
    for bad in ({**ok, "iss": "x"}, {**ok, "flare_site": "central"}, {**ok, "sub": ""}, {}):
        assert authorize(bad, None) == {"authorized": False}


def test_a_call_that_outlived_its_token_is_signed_again_and_goes_on() -> None:
    from aiohttp import ClientResponseError, RequestInfo
    from yarl import URL

    clock = [0.0]
    calls: list[float] = []

    async def send(*args: Any) -> str:
        calls.append(clock[0])
        if len(calls) == 1:
            clock[0] += 63  # the server took 63 s to look at it: the token had expired
            raise ClientResponseError(RequestInfo(URL("http://x"), "POST", {}, URL("http://x")), (), status=403)
        if len(calls) == 3:
            raise ClientResponseError(RequestInfo(URL("http://x"), "POST", {}, URL("http://x")), (), status=403)
        return "ok"

    call = resigning(send, 30, clock=lambda: clock[0])
    assert asyncio.run(call("POST", "worker/x")) == "ok" and len(calls) == 2
    # A refusal within the token's lifetime is a real one: it raises.
    with pytest.raises(ClientResponseError):
        asyncio.run(call("POST", "worker/x"))


def test_the_site_worker_serves_its_registry_queues_under_its_name(keys: dict[str, Any]) -> None:
    grant, _ = site_grant("site-1", str(keys["registry"]))
    assert edge_worker_argv(grant, "site-1-worker", ["--concurrency", "2"]) == [
        "edge", "worker", "--queues", "site-1", "--edge-hostname", "site-1-worker", "--concurrency", "2",
    ]  # fmt: skip
    with pytest.raises(TrustError, match="not one of its worker names"):
        edge_worker_argv(grant, "site-2-worker", [])
    with pytest.raises(TrustError, match="come from the registry"):
        edge_worker_argv(grant, "site-1-worker", ["--queues", "site-2"])
    with pytest.raises(TrustError, match="no enrolled signing key for 'site-9'"):
        site_grant("site-9", str(keys["registry"]))
    with pytest.raises(TrustError, match="no consortium registry"):
        site_grant("site-1", None)
    kid, key = load_signing_key(party_dir(keys["root"], "site-1"), "site-1")
    token = SiteSigner("site-1", "site-1-worker", kid, key).generate({"method": "worker/site-1-worker"})
    claims = verify_worker_token(token, Registry.from_file(Path(keys["registry"])))
    assert (claims["flare_site"], claims["sub"], claims["method"]) == (
        "site-1",
        "site-1-worker",
        "worker/site-1-worker",
    )


def test_behind_a_base_path_the_guard_still_checks(keys: dict[str, Any], guard: dict[str, Any]) -> None:
    m = "jobs/fetch/site-2-worker"
    status, out = _request(
        guard, "POST", f"/airflow/edge_worker/v1/{m}", _token(keys, "site-2", m), {"queues": ["site-1"]}
    )
    assert status == 403 and "may not fetch jobs of queue(s) ['site-1']" in out["detail"]
    guard["ti"] = ("site-2", "EdgeExecutor")
    assert _request(guard, "GET", "/airflow/execution/variables/flare_central_noise_secret", _ti_token("01"))[0] == 403
    assert guard["seen"] == []
