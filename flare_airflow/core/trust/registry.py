"""The consortium registry: the public keys of every party, as a JWKS the verifiers read.

Enrolment is adding a reviewed public JWK (made by ``flare-airflow site keygen``) to the file;
rotation is adding the new key id (both verify while both are listed); revocation is removing a
key id (its records are refused from then on). Nobody else is re-provisioned. Each key names the
party it speaks for (``flare_party``: a site, or ``central``): a key verifies records of that party
only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from flare_airflow.core.trust.errors import RegistryError, UnknownSigner
from flare_airflow.core.trust.keys import CENTRAL, PARTY_NAME, PUBLIC_FILE, b64url_decode, key_id

# A registry lists a few keys per party: far below this.
MAX_REGISTRY_BYTES = 4 << 20


@dataclass(frozen=True)
class BoxKey:
    """One enrolled box key: what the central side seals a site's links to, a site its report to."""

    kid: str
    party: str
    public: X25519PublicKey


@dataclass(frozen=True)
class SignerKey:
    """One enrolled signing key: its id, the party it speaks for, its public half."""

    kid: str
    party: str
    public: Ed25519PublicKey


class Registry:
    """Key id -> enrolled signing key. Box (X25519) keys are listed for sealing, not verifying."""

    def __init__(self, keys: Iterable[SignerKey], where: str, boxes: Iterable[BoxKey] = ()) -> None:
        self.where = where
        self._keys: dict[str, SignerKey] = {}
        for key in keys:
            if key.kid in self._keys:
                raise RegistryError(f"{where}: key id {key.kid!r} is listed twice; keep one")
            self._keys[key.kid] = key
        # Party -> its box keys in the order listed: the last is the one to seal to (a rotation
        # appends the new key; the old one stays listed while sealed messages to it may be open).
        self._boxes: dict[str, list[BoxKey]] = {}
        for box in boxes:
            self._boxes.setdefault(box.party, []).append(box)

    def __contains__(self, kid: object) -> bool:
        return kid in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def kids(self, party: str) -> list[str]:
        return sorted(k.kid for k in self._keys.values() if k.party == party)

    def signer(self, kid: str) -> SignerKey:
        key = self._keys.get(kid)
        if key is None:
            raise UnknownSigner(
                f"key id {kid!r} is not in the registry {self.where} (never enrolled, or revoked); enrol the party's "
                "public key there if it is genuine"
            )
        return key

    def box_key(self, party: str) -> BoxKey:
        """The box key to seal ``party``'s messages to; :class:`UnknownSigner` when none is enrolled."""
        boxes = self._boxes.get(party)
        if not boxes:
            raise UnknownSigner(
                f"{party!r} has no box (X25519) key in the registry {self.where}; enrol the public JWKS that "
                f"`flare-airflow {'central keygen' if party == CENTRAL else 'site keygen ' + party}` printed"
            )
        return boxes[-1]

    @classmethod
    def from_jwks(cls, data: Any, where: str) -> Registry:
        """A registry from a parsed JWKS (``{"keys": [...]}``); raises :class:`RegistryError` naming the entry."""
        if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
            raise RegistryError(f"{where}: a registry is a JSON object with a list 'keys' (a JWKS)")
        keys, boxes = [], []
        for n, jwk in enumerate(data["keys"]):
            entry = f"{where}: keys[{n}]"
            if not isinstance(jwk, dict):
                raise RegistryError(f"{entry} is not an object")
            party, kid = jwk.get("flare_party"), jwk.get("kid")
            if not isinstance(party, str) or not PARTY_NAME.match(party):
                raise RegistryError(f"{entry}: flare_party must name a site or {CENTRAL!r}, got {party!r}")
            if not isinstance(kid, str) or not kid:
                raise RegistryError(f"{entry}: kid must be a non-empty string")
            if jwk.get("kty") != "OKP" or jwk.get("crv") not in ("Ed25519", "X25519"):
                raise RegistryError(f"{entry} ({kid}): only OKP Ed25519 (sig) and X25519 (enc) keys are used")
            if jwk["crv"] == "X25519":
                try:
                    box = X25519PublicKey.from_public_bytes(b64url_decode(str(jwk.get("x", ""))))
                except (ValueError, TypeError) as exc:
                    raise RegistryError(f"{entry} ({kid}): x is not a 32-byte X25519 key ({exc})") from None
                if kid != key_id(party, box):
                    raise RegistryError(f"{entry}: kid {kid!r} is not this key's id {key_id(party, box)!r}")
                boxes.append(BoxKey(kid=kid, party=party, public=box))
                continue
            try:
                public = Ed25519PublicKey.from_public_bytes(b64url_decode(str(jwk.get("x", ""))))
            except (ValueError, TypeError) as exc:
                raise RegistryError(f"{entry} ({kid}): x is not a 32-byte Ed25519 key ({exc})") from None
            if kid != key_id(party, public):
                # The id is derived from the key: a copied id on another key would let a verifier name the wrong key.
                raise RegistryError(f"{entry}: kid {kid!r} is not this key's id {key_id(party, public)!r}")
            keys.append(SignerKey(kid=kid, party=party, public=public))
        return cls(keys, where, boxes)

    @classmethod
    def from_file(cls, path: Path) -> Registry:
        try:
            with open(path, "rb") as fh:
                text = fh.read(MAX_REGISTRY_BYTES + 1)
        except OSError as exc:
            raise RegistryError(
                f"cannot read the key registry {path}: {exc.strerror or exc}; check [flare] site_keys"
            ) from None
        if len(text) > MAX_REGISTRY_BYTES:
            raise RegistryError(f"the key registry {path} is larger than {MAX_REGISTRY_BYTES} bytes")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise RegistryError(f"the key registry {path} is not JSON: {exc}") from None
        return cls.from_jwks(data, str(path))

    @classmethod
    def from_key_dir(cls, key_dir: Path) -> Registry:
        """The one-machine registry: every party's ``public.jwks.json`` under a key directory."""
        files = sorted(key_dir.glob(f"sites/*/{PUBLIC_FILE}"))
        if (key_dir / CENTRAL / PUBLIC_FILE).exists():
            files.append(key_dir / CENTRAL / PUBLIC_FILE)
        keys: list[SignerKey] = []
        boxes: list[BoxKey] = []
        for path in files:
            found = cls.from_file(path)
            keys.extend(found._keys.values())
            boxes.extend(box for listed in found._boxes.values() for box in listed)
        return cls(keys, f"the keys under {key_dir}", boxes)
