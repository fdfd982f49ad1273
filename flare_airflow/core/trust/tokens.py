"""A site worker's tokens for the Edge worker API: compact JWS (RFC 7515), EdDSA over Ed25519
(RFC 8037), signed with the site's own key and verified against the consortium registry.

They replace the HS512 tokens edge3 signs with the shared ``[api_auth] jwt_secret``: a site holds
its own signing key only, so nothing it holds can mint a token for another site, for the REST API
or for the Execution API. edge3 checks the signature against the registry (``[edge]
trusted_jwks_url``); :func:`verify_worker_token` is the same check done by our middleware, which in
addition binds the key to the site the token speaks for (edge3's verifier sees the claims, not the kid).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flare_airflow.core.trust.errors import TrustError
from flare_airflow.core.trust.keys import b64url, b64url_decode
from flare_airflow.core.trust.registry import Registry

# The issuer of every site worker token; the central side sets ``[edge] jwt_issuer`` to it.
ISSUER = "flare-airflow-site"
# The claim naming the site a token speaks for: the site whose key signed it.
SITE_CLAIM = "flare_site"
# Long enough for a heartbeat round trip on a loaded machine; short enough that a copied token is
# soon useless. A request that outlives it is signed again (flare_airflow/edge/worker.py).
VALID_FOR = 30
MAX_TOKEN_BYTES = 8192


class TokenRefused(TrustError):
    """A worker token is not a valid token of an enrolled site."""


def sign_worker_token(
    key: Ed25519PrivateKey,
    kid: str,
    *,
    site: str,
    worker: str,
    method: str,
    valid_for: float = VALID_FOR,
    now: float | None = None,
) -> str:
    """A token for one Edge worker API call (``method``: the path after ``/edge_worker/v1/``)."""
    issued = int(time.time() if now is None else now)
    header = {"alg": "EdDSA", "typ": "JWT", "kid": kid}
    claims = {
        "iss": ISSUER,
        "sub": worker,
        SITE_CLAIM: site,
        "method": method,
        "iat": issued,
        "nbf": issued,
        "exp": issued + int(valid_for),
        "jti": uuid.uuid4().hex,
    }
    signing_input = f"{_part(header)}.{_part(claims)}".encode()
    return f"{signing_input.decode()}.{b64url(key.sign(signing_input))}"


def _part(obj: dict[str, Any]) -> str:
    return b64url(json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


def verify_worker_token(
    token: str, registry: Registry, *, leeway: float = 30, now: float | None = None
) -> dict[str, Any]:
    """The claims of ``token`` once proven: EdDSA, signed by an enrolled key of the site its
    ``flare_site`` claim names, issued by a site worker, within its validity. Else :class:`TokenRefused`."""
    token = token.removeprefix("Bearer ").strip()
    if len(token) > MAX_TOKEN_BYTES or token.count(".") != 2:
        raise TokenRefused("the Authorization header is not a compact JWS token")
    head, body, sig = token.split(".")
    try:
        header = json.loads(b64url_decode(head))
        claims = json.loads(b64url_decode(body))
        signature = b64url_decode(sig)
    except ValueError:
        raise TokenRefused("the token's header, claims or signature is not base64url JSON") from None
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise TokenRefused("the token's header and claims must be JSON objects")
    if header.get("alg") != "EdDSA":
        raise TokenRefused(f"worker tokens are EdDSA, signed with the site's key; this one is {header.get('alg')!r}")
    kid = header.get("kid")
    if not isinstance(kid, str) or kid not in registry:
        raise TokenRefused(f"the token's key id {kid!r} is not an enrolled key (never enrolled, or revoked)")
    signer = registry.signer(kid)
    try:
        signer.public.verify(signature, f"{head}.{body}".encode())
    except InvalidSignature:
        raise TokenRefused(f"the token's signature does not verify with {kid}") from None
    if claims.get(SITE_CLAIM) != signer.party or claims.get("iss") != ISSUER:
        raise TokenRefused(
            f"a token signed by {signer.party!r}'s key speaks for {claims.get(SITE_CLAIM)!r}: a site's key "
            "speaks only for that site"
        )
    at = time.time() if now is None else now
    exp, nbf = claims.get("exp"), claims.get("nbf", claims.get("iat"))
    if not isinstance(exp, int | float) or not isinstance(nbf, int | float):
        raise TokenRefused("the token has no exp/nbf")
    if at > exp + leeway:
        raise TokenRefused(f"the token expired {at - exp:.0f} s ago")
    if at < nbf - leeway:
        raise TokenRefused("the token is not valid yet (check the worker's clock)")
    if not isinstance(claims.get("sub"), str) or not isinstance(claims.get("method"), str):
        raise TokenRefused("the token names no worker (sub) or method")
    return claims
