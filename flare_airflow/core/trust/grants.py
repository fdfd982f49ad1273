"""What each enrolled site may do on the control plane: its queues, its worker names, and the
central Variables/Connections (none by default) its tasks may resolve through the Execution API.

The grants live in the consortium registry beside the keys, so enrolment decides both who a site
is and what its worker may serve: a site with an enrolled signing key gets, unless the registry's
``flare_sites`` section says otherwise, the queue named after it and the worker ``<site>-worker``::

    {"keys": [...],
     "flare_sites": {"site-2": {"queues": ["hospital-b"], "workers": ["site-2-worker"],
                                "variables": [], "connections": []}}}

Fail closed: a queue or worker name claimed by two sites, or a site with no queue, is a
:class:`RegistryError`; a name the registry does not grant to a site belongs to nobody.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flare_airflow.core.trust.errors import RegistryError
from flare_airflow.core.trust.keys import CENTRAL, PARTY_NAME
from flare_airflow.core.trust.registry import MAX_REGISTRY_BYTES, Registry

SECTION = "flare_sites"
_FIELDS = ("queues", "workers", "variables", "connections")
# Where the site reaches the object store, when that is not where the central side does (a split
# view of the network): its store links are signed for this endpoint (SigV4 signs the host).
_ENDPOINT = "store_endpoint"
_ENDPOINT_FORM = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+/?\Z")


@dataclass(frozen=True)
class SiteGrant:
    """One site's control-plane grant."""

    site: str
    queues: tuple[str, ...]
    workers: tuple[str, ...]
    variables: frozenset[str] = frozenset()
    connections: frozenset[str] = frozenset()
    store_endpoint: str | None = None

    def may_resolve(self, kind: str, name: str) -> bool:
        return name in (self.variables if kind == "variable" else self.connections)


def default_worker(site: str) -> str:
    """The worker name a site gets unless the registry names others (``site worker``'s default)."""
    return f"{site}-worker"


@dataclass(frozen=True)
class Grants:
    """Every enrolled site's grant, with the reverse maps a check needs (queue -> site, worker -> site)."""

    sites: Mapping[str, SiteGrant]
    where: str

    def grant(self, site: str) -> SiteGrant | None:
        return self.sites.get(site)

    def site_of_queue(self, queue: str) -> str | None:
        return next((g.site for g in self.sites.values() if queue in g.queues), None)

    def site_of_worker(self, worker: str) -> str | None:
        return next((g.site for g in self.sites.values() if worker in g.workers), None)

    @classmethod
    def from_registry(cls, data: Any, registry: Registry) -> Grants:
        """The grants of every site with an enrolled signing key in ``registry`` (parsed from ``data``)."""
        where = registry.where
        section = data.get(SECTION, {}) if isinstance(data, dict) else {}
        if not isinstance(section, dict):
            raise RegistryError(f"{where}: {SECTION} must be an object of site -> grant")
        # The registry parsed ``data`` already: every Ed25519 entry names a valid party.
        signing = [k for k in data["keys"] if k.get("crv") == "Ed25519" and k.get("kid") in registry]
        enrolled = sorted({str(k["flare_party"]) for k in signing} - {CENTRAL})
        unknown = sorted(set(section) - set(enrolled))
        if unknown:
            raise RegistryError(
                f"{where}: {SECTION} names {unknown}, which have no enrolled signing key; enrol them first"
            )
        sites: dict[str, SiteGrant] = {}
        for site in enrolled:
            entry = section.get(site, {})
            if not isinstance(entry, dict) or set(entry) - {*_FIELDS, _ENDPOINT}:
                raise RegistryError(f"{where}: {SECTION}[{site!r}] may hold only {[*_FIELDS, _ENDPOINT]}")
            endpoint = entry.get(_ENDPOINT)
            if endpoint is not None and not (isinstance(endpoint, str) and _ENDPOINT_FORM.match(endpoint)):
                raise RegistryError(
                    f"{where}: {SECTION}[{site!r}].{_ENDPOINT} must be an http(s)://host[:port] URL, got {endpoint!r}"
                )
            lists = {f: _names(entry.get(f), f"{where}: {SECTION}[{site!r}].{f}") for f in _FIELDS}
            queues = lists["queues"] if "queues" in entry else (site,)
            if not queues:
                raise RegistryError(f"{where}: {SECTION}[{site!r}].queues is empty: a site's worker serves its queues")
            sites[site] = SiteGrant(
                site=site,
                queues=queues,
                workers=lists["workers"] if "workers" in entry else (default_worker(site),),
                variables=frozenset(lists["variables"]),
                connections=frozenset(lists["connections"]),
                store_endpoint=endpoint,
            )
        _unique(sites.values(), "queues", where)
        _unique(sites.values(), "workers", where)
        return cls(sites=sites, where=where)

    @classmethod
    def from_file(cls, path: Path) -> Grants:
        return read_registry(path)[1]


def read_registry(path: Path) -> tuple[Registry, Grants]:
    """The registry file's public keys and its sites' grants, from one bounded read."""
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read(MAX_REGISTRY_BYTES + 1))
    except OSError as exc:
        raise RegistryError(f"cannot read the key registry {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise RegistryError(f"the key registry {path} is not JSON: {exc}") from None
    registry = Registry.from_jwks(data, str(path))
    return registry, Grants.from_registry(data, registry)


def _names(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and PARTY_NAME.match(v) for v in value):
        raise RegistryError(f"{where} must be a list of names (letters, digits, '.', '_', '-')")
    return tuple(value)


def _unique(grants: Iterable[SiteGrant], field: str, where: str) -> None:
    owner: dict[str, str] = {}
    for grant in grants:
        for name in getattr(grant, field):
            if owner.setdefault(name, grant.site) != grant.site:
                raise RegistryError(
                    f"{where}: {field[:-1]} {name!r} is granted to both {owner[name]!r} and {grant.site!r}; "
                    "a queue or worker name belongs to one site"
                )
