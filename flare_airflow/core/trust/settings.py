"""Where a worker keeps its keys and which registry it trusts: the two modes of trust.

- **Strict** (a registry is configured, ``[flare] site_keys``): records are verified against that
  file only; an unsigned record, or one signed with a key it does not list, is refused; private
  keys are never made on the fly (a missing key says how to make and enrol it).
- **One machine** (no registry: the embedded default, ``make demo``): each party's keys are made on
  first use under the worker's key directory and the registry is every public key found there.
  Records are still signed and checked, so a record moved to another slot or round, or changed
  after signing, is refused; but an unsigned record or an unknown key is only noted -- without a
  registry there is nobody to say who may sign. A deployment across sites configures a registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flare_airflow.core.trust.errors import UnknownSigner, UnsignedRecord
from flare_airflow.core.trust.keys import signing_key_for
from flare_airflow.core.trust.records import verify_record
from flare_airflow.core.trust.registry import Registry


@dataclass(frozen=True)
class TrustSettings:
    """A worker's key directory and, in strict mode, the consortium registry it verifies against."""

    key_dir: str
    registry_path: str | None = None

    @property
    def strict(self) -> bool:
        return self.registry_path is not None

    def registry(self) -> Registry:
        if self.registry_path is not None:
            return Registry.from_file(Path(self.registry_path))
        return Registry.from_key_dir(Path(self.key_dir))

    def signing_key(self, party: str) -> tuple[str, Ed25519PrivateKey]:
        """``party``'s key id and signing key on this worker (made on first use without a registry)."""
        return signing_key_for(Path(self.key_dir), party, create=not self.strict)

    def verify(
        self, signed: Any, *, party: str, expect: Mapping[str, Any], what: str, registry: Registry | None = None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """(payload, None) for a proven record; raises ``TrustError`` for a refused one. Without a
        registry, an unsigned record or an unknown key gives (None, note) instead: not proven, not refused."""
        try:
            return verify_record(signed, registry or self.registry(), party=party, expect=expect, what=what), None
        except (UnsignedRecord, UnknownSigner) as exc:
            if self.strict:
                raise
            return None, f"{exc} (accepted unverified: no key registry is configured)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrustSettings:
        return cls(key_dir=str(data["key_dir"]), registry_path=data.get("registry_path"))
