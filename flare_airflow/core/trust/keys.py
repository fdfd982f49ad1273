"""A party's keys: an Ed25519 signing key and an X25519 box key.

Layout of a worker's key directory (``[flare] key_dir``)::

    <key_dir>/sites/<site>/sign.pem          Ed25519 private key, PKCS#8 PEM, mode 0600
    <key_dir>/sites/<site>/box.pem           X25519 private key (sealed capabilities, issue 36 item 4)
    <key_dir>/sites/<site>/public.jwks.json  the public halves as a JWKS: what the site hands in
    <key_dir>/central/sign.pem               the central (aggregation) side's signing key
    <key_dir>/central/box.pem                its box key: sites seal their counts and metrics to it
    <key_dir>/central/public.jwks.json

Private halves are written once, 0600, in a 0700 directory, and never read by anything but the
party's own worker. A key id (``kid``) is ``<party>.<RFC 7638 thumbprint, 16 characters>``: the
same public key always has the same id, and a rotated key has a new one.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from flare_airflow.core.trust.errors import KeyMissing, TrustError

# The party name of the aggregation side in key ids and the registry; sites live under sites/.
CENTRAL = "central"
SIGN_FILE = "sign.pem"
BOX_FILE = "box.pem"
PUBLIC_FILE = "public.jwks.json"


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _raw(public: Ed25519PublicKey | X25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(party: str, public: Ed25519PublicKey | X25519PublicKey) -> str:
    """``<party>.<thumbprint>``: the RFC 7638 JWK thumbprint (sha256 of the canonical members), shortened."""
    crv = "Ed25519" if isinstance(public, Ed25519PublicKey) else "X25519"
    members = json.dumps({"crv": crv, "kty": "OKP", "x": b64url(_raw(public))}, separators=(",", ":"), sort_keys=True)
    return f"{party}.{b64url(hashlib.sha256(members.encode()).digest())[:16]}"


def public_jwk(party: str, public: Ed25519PublicKey | X25519PublicKey) -> dict[str, str]:
    """The JWK (RFC 8037 OKP) of a public key, with its key id and the party it speaks for."""
    sig = isinstance(public, Ed25519PublicKey)
    return {
        "kty": "OKP",
        "crv": "Ed25519" if sig else "X25519",
        "x": b64url(_raw(public)),
        "kid": key_id(party, public),
        "use": "sig" if sig else "enc",
        "flare_party": party,
    }


# What may name a party (a site, or central): one path component, as the store requires of site names.
PARTY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


def checked_party(party: str) -> str:
    """``party`` if it can name a site (or ``central``) in key ids and directories, else ``TrustError``."""
    if not PARTY_NAME.match(party) or ".." in party:
        raise TrustError(
            f"{party!r} cannot name a party: use the site's name as in the job (letters, digits, '.', '_', '-'; "
            "no '/', no '..')"
        )
    return party


def party_dir(key_dir: Path, party: str) -> Path:
    """Where ``party``'s keys live under a worker's key directory."""
    return key_dir / CENTRAL if party == CENTRAL else key_dir / "sites" / checked_party(party)


def _write_private(path: Path, pem: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    tmp.replace(path)


def _pem(key: Ed25519PrivateKey | X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class PartyKeys:
    """What :func:`generate_keys` made: where, and the public JWKS to enrol."""

    party: str
    directory: Path
    jwks: dict[str, Any]
    retired: tuple[str, ...] = ()

    @property
    def signing_kid(self) -> str:
        return next(k["kid"] for k in self.jwks["keys"] if k["use"] == "sig")


def generate_keys(party: str, directory: Path, *, box: bool = True, rotate: bool = False) -> PartyKeys:
    """Make ``party``'s keys in ``directory`` (created 0700) and write its public JWKS beside them.

    Refuses to replace existing keys unless ``rotate``: the old private halves are then kept as
    ``<file>.<kid>.retired`` (0600) -- verifiers keep accepting the old key id while the registry
    lists it, and its owner may still need it to prove an old record.
    """
    checked_party(party)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    sign_path, box_path = directory / SIGN_FILE, directory / BOX_FILE
    retired: list[str] = []
    if sign_path.exists():
        if not rotate:
            raise TrustError(
                f"{party}: {sign_path} already holds a signing key; keep it, or make a new one with --rotate "
                "(then enrol the new key id and revoke the old one once no run needs it)"
            )
        old_kid = load_signing_key(directory, party)[0]
        for path in (sign_path, box_path):
            if path.exists():
                path.replace(path.with_name(f"{path.name}.{old_kid}.retired"))
        retired.append(old_kid)
    signing = Ed25519PrivateKey.generate()
    _write_private(sign_path, _pem(signing))
    keys = [public_jwk(party, signing.public_key())]
    if box:
        boxing = X25519PrivateKey.generate()
        _write_private(box_path, _pem(boxing))
        keys.append(public_jwk(party, boxing.public_key()))
    jwks = {"keys": keys}
    # Renamed into place: a verifier on the same machine reads the key directory at any time.
    public = directory / PUBLIC_FILE
    tmp = public.with_name(f".{public.name}.tmp")
    tmp.write_text(json.dumps(jwks, indent=2) + "\n")
    tmp.replace(public)
    return PartyKeys(party=party, directory=directory, jwks=jwks, retired=tuple(retired))


def load_signing_key(directory: Path, party: str) -> tuple[str, Ed25519PrivateKey]:
    """``party``'s key id and signing key from ``directory``; refuses a key others can read."""
    path = directory / SIGN_FILE
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except FileNotFoundError:
        raise KeyMissing(
            f"{party}: no signing key at {path}; make it on this worker with `flare-airflow "
            f"{'central keygen' if party == CENTRAL else 'site keygen ' + party}` and enrol its public key "
            "in the consortium registry"
        ) from None
    except OSError as exc:
        raise KeyMissing(f"{party}: cannot read the signing key {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TrustError(
            f"{party}: the signing key {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
            f"`chmod 600 {path}`, and make a new key (--rotate) if anyone else may have copied it"
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise TrustError(f"{party}: {path} is not a PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise TrustError(f"{party}: {path} is a {type(key).__name__}, not an Ed25519 signing key")
    return key_id(party, key.public_key()), key


def signing_key_for(key_dir: Path, party: str, *, create: bool) -> tuple[str, Ed25519PrivateKey]:
    """``party``'s signing key under a worker's key directory; with ``create`` (no registry: the
    one-machine default) made on first use, else :class:`KeyMissing` says how to make and enrol it."""
    directory = party_dir(key_dir, party)
    if create and not (directory / SIGN_FILE).exists():
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Site tasks of one machine start together: one makes the key, the others load it.
            with open(directory / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (directory / SIGN_FILE).exists():
                    generate_keys(party, directory)
        except OSError as exc:
            raise KeyMissing(
                f"{party}: cannot make its keys in {directory}: {exc.strerror or exc}; set [flare] key_dir "
                "(or FLARE_KEY_DIR) to a directory this worker's user can write"
            ) from None
    return load_signing_key(directory, party)
