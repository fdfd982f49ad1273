"""``flare-airflow site worker SITE``: edge3's ``airflow edge worker`` for one site, signing its
API calls with the site's own Ed25519 key instead of the shared ``[api_auth] jwt_secret``.

edge3's worker client signs each call with ``api_client.jwt_generator()``; the shim replaces it
with :func:`~flare_airflow.core.trust.tokens.sign_worker_token` for this site and worker name,
and wraps ``api_client._make_generic_request`` so that a call refused after it outlived its token
(seen at load 20+: a 63 s request, both workers exited) is signed again and sent again instead of
ending the worker. The queues and the worker name come from the site's grant in the registry:
the API server's middleware refuses any other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from flare_airflow.core.trust import TrustError
from flare_airflow.core.trust.grants import Grants, SiteGrant
from flare_airflow.core.trust.tokens import VALID_FOR, sign_worker_token

log = logging.getLogger(__name__)


class SiteSigner:
    """What edge3's client calls ``jwt_generator()`` for: ``generate({"method": path})``."""

    def __init__(self, site: str, worker: str, kid: str, key: Any, valid_for: float = VALID_FOR) -> None:
        self.site, self.worker, self.kid, self._key, self.valid_for = site, worker, kid, key, valid_for

    def generate(self, extras: dict[str, Any] | None = None, **_: Any) -> str:
        method = str((extras or {}).get("method", ""))
        return sign_worker_token(
            self._key, self.kid, site=self.site, worker=self.worker, method=method, valid_for=self.valid_for
        )


def resigning(
    send: Callable[..., Awaitable[Any]], valid_for: float, *, clock: Callable[[], float] = time.monotonic
) -> Callable[..., Awaitable[Any]]:
    """``send`` (edge3's request function, which signs each attempt anew) that, when a call is
    refused (403) after it outlived its token, signs it again and goes on. A call refused within
    its token's lifetime is a real refusal and raises as before."""
    from aiohttp import ClientResponseError

    async def call(*args: Any, **kwargs: Any) -> Any:
        while True:
            started = clock()
            try:
                return await send(*args, **kwargs)
            except ClientResponseError as exc:
                took = clock() - started
                if exc.status != 403 or took < valid_for:
                    raise
                log.warning("%s took %.0f s, longer than its token (%s s): signing it again", args[:2], took, valid_for)

    return call


def install_shim(signer: SiteSigner) -> None:
    """Make edge3's worker client in this process sign with ``signer``."""
    from airflow.providers.edge3.cli import api_client

    api_client.jwt_generator = lambda: signer  # type: ignore[assignment]
    api_client._make_generic_request = resigning(api_client._make_generic_request, signer.valid_for)  # type: ignore[assignment]


def site_grant(site: str, registry_path: str | None) -> tuple[SiteGrant, Grants]:
    if registry_path is None:
        raise TrustError(
            f"site worker {site}: no consortium registry is configured ([flare] site_keys or FLARE_SITE_KEYS); "
            "a site's worker authenticates with its key, checked against that registry (docs/deploy-across-sites.md)"
        )
    from pathlib import Path

    grants = Grants.from_file(Path(registry_path))
    grant = grants.grant(site)
    if grant is None:
        raise TrustError(
            f"site worker {site}: the registry {registry_path} has no enrolled signing key for {site!r}; run "
            f"`flare-airflow site keygen {site}` here and have the central admin enrol its public.jwks.json"
        )
    return grant, grants


def edge_worker_argv(grant: SiteGrant, name: str, extra: list[str]) -> list[str]:
    """The ``airflow edge worker`` arguments for ``grant``: its queues, its worker name."""
    if name not in grant.workers:
        raise TrustError(f"site worker {grant.site}: {name!r} is not one of its worker names {list(grant.workers)}")
    if any(
        a in ("-q", "--queues", "-H", "--edge-hostname") or a.startswith(("--queues=", "--edge-hostname="))
        for a in extra
    ):
        raise TrustError(
            "site worker: the queues and the worker name come from the registry; drop --queues/--edge-hostname"
        )
    return ["edge", "worker", "--queues", ",".join(grant.queues), "--edge-hostname", name, *extra]


def run_site_worker(site: str, name: str | None, extra: list[str]) -> int:
    from airflow.cli import cli_parser

    from flare_airflow.operators.trust import trust_settings

    settings = trust_settings()
    grant, _ = site_grant(site, settings.registry_path)
    name = name or grant.workers[0]
    argv = edge_worker_argv(grant, name, extra)
    kid, key = settings.signing_key(site)
    install_shim(SiteSigner(site, name, kid, key))
    log.info("site %s: edge worker %s on queues %s, signing with %s", site, name, list(grant.queues), kid)
    args = cli_parser.get_parser().parse_args(argv)
    args.func(args)
    return 0
