"""edge3's ``[edge] jwt_verifier``: with ``[edge] trusted_jwks_url`` pointing at the consortium
registry, edge3 proves a worker token's signature; this says whether the identity may act as an
Edge worker at all. The central side's own key is in the registry too (it signs global records),
so a token must say it is a site worker's, for a site; the middleware then binds the signing key
to that site and the worker to its grant (:mod:`flare_airflow.edge.middleware`)."""

from __future__ import annotations

from typing import Any

from flare_airflow.core.trust.keys import CENTRAL
from flare_airflow.core.trust.tokens import ISSUER, SITE_CLAIM


def authorize(claims: dict[str, Any], context: Any) -> dict[str, bool]:
    site = claims.get(SITE_CLAIM)
    ok = claims.get("iss") == ISSUER and isinstance(site, str) and site not in ("", CENTRAL) and bool(claims.get("sub"))
    return {"authorized": ok}
