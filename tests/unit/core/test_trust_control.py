"""The control-plane rules (flare_airflow/core/trust/{grants,tokens,control}.py), no servers."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest

from flare_airflow.core.trust import RegistryError, generate_keys
from flare_airflow.core.trust.control import Refused, check_secret_request, check_worker_call
from flare_airflow.core.trust.grants import Grants
from flare_airflow.core.trust.keys import load_signing_key, party_dir
from flare_airflow.core.trust.registry import Registry
from flare_airflow.core.trust.tokens import TokenRefused, sign_worker_token, verify_worker_token

NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("keys")
    jwks: list[dict[str, Any]] = []
    for party in ("site-1", "site-2", "central"):
        jwks += generate_keys(party, party_dir(root, party), box=party != "central").jwks["keys"]
    return {"root": root, "data": {"keys": jwks}}


def _registry(keys: dict[str, Any], sites: dict[str, Any] | None = None) -> tuple[Registry, Grants, dict[str, Any]]:
    data = dict(keys["data"], **({"flare_sites": sites} if sites is not None else {}))
    registry = Registry.from_jwks(data, "registry.json")
    return registry, Grants.from_registry(data, registry), data


def _token(keys: dict[str, Any], party: str, *, site: str | None = None, worker: str | None = None, method: str = "x",
           now: float = NOW) -> str:  # fmt: skip
    kid, key = load_signing_key(party_dir(keys["root"], party), party)
    return sign_worker_token(key, kid, site=site or party, worker=worker or f"{party}-worker", method=method, now=now)


def test_grants_default_to_the_sites_queue_and_worker_and_nothing_central(keys: dict[str, Any]) -> None:
    _, grants, _ = _registry(keys)
    assert sorted(grants.sites) == ["site-1", "site-2"]  # central is no site
    g = grants.grant("site-1")
    assert g is not None and g.queues == ("site-1",) and g.workers == ("site-1-worker",)
    assert not g.variables and not g.connections
    assert grants.site_of_queue("site-2") == "site-2" and grants.site_of_worker("site-2-worker") == "site-2"
    assert grants.site_of_queue("default") is None


@pytest.mark.parametrize(
    ("sites", "message"),
    [
        ({"site-1": {"queues": ["q"]}, "site-2": {"queues": ["q"]}}, "queue 'q' is granted to both"),
        ({"site-1": {"workers": ["w"]}, "site-2": {"workers": ["w"]}}, "worker 'w' is granted to both"),
        ({"site-1": {"queues": []}}, "queues is empty"),
        ({"site-9": {}}, "no enrolled signing key"),
        ({"site-1": {"queue": ["q"]}}, "may hold only"),
        ({"site-1": {"variables": "x"}}, "must be a list of names"),
        ({"site-1": {"store_endpoint": "file:///etc"}}, "must be an http"),
        ({"site-1": {"store_endpoint": "http://h/ x"}}, "must be an http"),
    ],
)
def test_ambiguous_or_unknown_grants_are_refused(keys: dict[str, Any], sites: dict[str, Any], message: str) -> None:
    with pytest.raises(RegistryError, match=message):
        _registry(keys, sites)


def test_a_grant_may_name_the_sites_own_view_of_the_store(keys: dict[str, Any]) -> None:
    _, grants, _ = _registry(keys, {"site-1": {"store_endpoint": "http://10.1.1.1:9000"}})
    assert grants.grant("site-1").store_endpoint == "http://10.1.1.1:9000"  # type: ignore[union-attr]
    assert grants.grant("site-2").store_endpoint is None  # type: ignore[union-attr]


def test_a_site_token_verifies_and_names_its_site(keys: dict[str, Any]) -> None:
    registry, _, _ = _registry(keys)
    claims = verify_worker_token(_token(keys, "site-1", method="jobs/fetch/site-1-worker"), registry, now=NOW)
    assert (claims["flare_site"], claims["sub"], claims["method"]) == (
        "site-1",
        "site-1-worker",
        "jobs/fetch/site-1-worker",
    )


def _forged_hs512(claims: dict[str, Any], secret: bytes) -> str:
    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    head = part({"alg": "HS512", "typ": "JWT", "kid": "site-1.x"}) + "." + part(claims)
    sig = hmac.new(secret, head.encode(), hashlib.sha512).digest()
    return head + "." + base64.urlsafe_b64encode(sig).rstrip(b"=").decode()


def test_a_token_is_refused_unless_its_own_sites_key_signed_it_in_time(keys: dict[str, Any]) -> None:
    registry, _, _ = _registry(keys)
    # site-2's key speaking for site-1
    with pytest.raises(TokenRefused, match=r"signed by 'site-2'.s key speaks for 'site-1'"):
        verify_worker_token(_token(keys, "site-2", site="site-1"), registry, now=NOW)
    # the central key (in the registry for global records) is no site's
    with pytest.raises(TokenRefused, match="speaks for"):
        verify_worker_token(_token(keys, "central", site="site-1"), registry, now=NOW)
    good = _token(keys, "site-1")
    head, body, sig = good.split(".")
    tampered = json.loads(base64.urlsafe_b64decode(body + "=="))
    tampered["sub"] = "site-2-worker"
    body2 = base64.urlsafe_b64encode(json.dumps(tampered).encode()).rstrip(b"=").decode()
    with pytest.raises(TokenRefused, match="does not verify"):
        verify_worker_token(f"{head}.{body2}.{sig}", registry, now=NOW)
    with pytest.raises(TokenRefused, match="expired"):
        verify_worker_token(good, registry, now=NOW + 30 + 31)
    with pytest.raises(TokenRefused, match="EdDSA"):
        verify_worker_token(_forged_hs512({"flare_site": "site-1"}, b"anything"), registry, now=NOW)
    with pytest.raises(TokenRefused, match="compact JWS"):
        verify_worker_token("", registry, now=NOW)
    # revoked: the same token against a registry without site-1's signing key
    kept = [k for k in keys["data"]["keys"] if not (k["flare_party"] == "site-1" and k["use"] == "sig")]
    with pytest.raises(TokenRefused, match="not an enrolled key"):
        verify_worker_token(good, Registry.from_jwks({"keys": kept}, "r"), now=NOW)


def _claims(site: str, method: str, worker: str | None = None) -> dict[str, Any]:
    return {"flare_site": site, "sub": worker or f"{site}-worker", "method": method}


def _call(grants: Grants, verb: str, method: str, body: Any, claims: dict[str, Any], owner: str | None = None) -> None:
    check_worker_call(verb, method, body, claims, grants, lambda key: owner)


@pytest.mark.parametrize(
    ("verb", "method", "body", "claims", "owner", "message"),
    [
        ("POST", "jobs/fetch/site-2-worker", {"queues": ["site-1"]}, _claims("site-2", "jobs/fetch/site-2-worker"),
         None, r"may not fetch jobs of queue\(s\) \['site-1'\]"),
        ("POST", "jobs/fetch/site-2-worker", {"queues": None}, _claims("site-2", "jobs/fetch/site-2-worker"),
         None, "must name its queues"),
        ("POST", "jobs/fetch/site-2-worker", {"queues": []}, _claims("site-2", "jobs/fetch/site-2-worker"),
         None, "must name its queues"),
        ("POST", "worker/site-1-worker", {"queues": ["site-1"]},
         _claims("site-2", "worker/site-1-worker", "site-1-worker"), None, "site 'site-1'.s worker"),
        ("PATCH", "worker/site-2-worker", {"queues": ["site-2", "site-1"]}, _claims("site-2", "worker/site-2-worker"),
         None, "may not register or heartbeat for queue"),
        ("PATCH", "worker/queues/site-2-worker", {"new_queues": ["site-1"]},
         _claims("site-2", "worker/queues/site-2-worker"), None, "may not add queue"),
        ("PATCH", "jobs/state/d/round_1.site-1/r/1/-1/failed", None,
         _claims("site-2", "jobs/state/d/round_1.site-1/r/1/-1/failed"), "site-1-worker",
         "may not jobs/state for job d.round_1.site-1 run r try 1 map -1: worker 'site-1-worker' took it"),
        ("POST", "logs/push/d/round_1.site-1/r/1/-1", {}, _claims("site-2", "logs/push/d/round_1.site-1/r/1/-1"),
         None, "no worker took it"),
        ("POST", "jobs/fetch/site-2-worker", {"queues": ["site-2"]}, _claims("site-2", "worker/site-2-worker"),
         None, "a token signed for 'worker/site-2-worker' was used for 'jobs/fetch/site-2-worker'"),
        ("DELETE", "worker/site-2-worker", {}, _claims("site-2", "worker/site-2-worker"), None,
         "is not a call a site's worker makes"),
    ],
    ids=["fetch-other-queue", "fetch-no-queue", "fetch-empty-queues", "register-as-other-worker",
         "heartbeat-other-queue", "add-other-queue", "state-of-other-job", "log-of-untaken-job",
         "token-for-another-call", "unknown-call"],
)  # fmt: skip
def test_a_site_may_not_act_beyond_its_grant(
    keys: dict[str, Any], verb: str, method: str, body: Any, claims: dict[str, Any], owner: str | None, message: str
) -> None:
    _, grants, _ = _registry(keys)
    with pytest.raises(Refused, match=message):
        _call(grants, verb, method, body, claims, owner)


def test_a_site_may_do_what_its_worker_does(keys: dict[str, Any]) -> None:
    _, grants, _ = _registry(keys, {"site-2": {"queues": ["hospital-b", "site-2"]}})
    c = _claims
    _call(grants, "POST", "worker/site-2-worker", {"queues": ["hospital-b"]}, c("site-2", "worker/site-2-worker"))
    _call(
        grants,
        "PATCH",
        "worker/site-2-worker",
        {"queues": ["hospital-b", "site-2"]},
        c("site-2", "worker/site-2-worker"),
    )
    _call(grants, "POST", "jobs/fetch/site-2-worker", {"queues": ["site-2"]}, c("site-2", "jobs/fetch/site-2-worker"))
    m = "jobs/state/d/round_1.site-2/manual__2026/1/-1/running"
    _call(grants, "PATCH", m, None, c("site-2", m), owner="site-2-worker")
    m = "logs/push/d/round_1.site-2/manual__2026/1/-1"
    _call(grants, "POST", m, None, c("site-2", m), owner="site-2-worker")
    _call(grants, "GET", "health", None, c("site-2", "health"))


def test_site_tasks_resolve_only_granted_central_secrets(keys: dict[str, Any]) -> None:
    _, grants, _ = _registry(keys, {"site-1": {"variables": ["shared_schema"]}})
    check_secret_request("variable", "flare_central_noise_secret", None, grants)  # a central task
    check_secret_request("variable", "shared_schema", "site-1", grants)
    for kind, name, site in (
        ("variable", "flare_central_noise_secret", "site-1"),
        ("connection", "flare_store", "site-1"),
        ("variable", "shared_schema", "site-2"),
        ("connection", "flare_store", "site-9"),  # no grant: fail closed
    ):
        with pytest.raises(Refused, match=f"may not resolve the central {kind} '{name}'"):
            check_secret_request(kind, name, site, grants)


def test_grants_read_from_a_registry_file(keys: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    path.write_text(json.dumps(dict(keys["data"], flare_sites={"site-2": {"queues": ["hospital-b"]}})))
    assert Grants.from_file(path).site_of_queue("hospital-b") == "site-2"
    with pytest.raises(RegistryError, match="cannot read"):
        Grants.from_file(tmp_path / "none.json")
