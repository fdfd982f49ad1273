"""Sealed boxes: a message only one party's box key opens (issue 36 items 3 and 4).

What the central side hands one site through XCom (that site's store links), and what a site hands
the aggregation (its sample count and metrics), travels sealed: XCom is readable by every task of
the run, so anything in clear there is every site's to read.

The construction is the usual ephemeral-static one (as libsodium's ``crypto_box_seal``, HPKE's
base mode): a fresh X25519 key per message, agreed with the recipient's box key; HKDF-SHA256 over
the shared secret, both public keys and the message's *context* derives a one-time key; ChaCha20-
Poly1305 encrypts, with the context as associated data. The context names what the message is for
-- kind, job, run, round, party -- so a sealed message opens only where it was meant: another
site's key, another round's context (last round's links replayed) or a changed byte all fail the
same way, with :class:`SealedOpenError`.

Text form: ``fa1.<kid>.<base64url(ephemeral public (32) || ciphertext+tag)>``: the key id says
which of the recipient's keys it needs (rotation), the ciphertext says nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from flare_airflow.core.trust.errors import KeyMissing, TrustError
from flare_airflow.core.trust.keys import BOX_FILE, b64url, b64url_decode, key_id, party_dir

PREFIX = "fa1"
_INFO = b"flare-airflow/sealed/v1\n"
# Each message has its own key (a fresh ephemeral key): a fixed nonce never repeats under one key.
_NONCE = bytes(12)
# Far above a round's links or a site's metrics; a bound keeps a hostile XCom from costing memory.
MAX_SEALED_CHARS = 1 << 20


class SealedOpenError(TrustError):
    """A sealed message does not open with this party's box key for this context."""


def seal_context(kind: str, **identity: Any) -> bytes:
    """The associated data of a sealed message: its kind and identity, in a canonical order."""
    fields = "".join(f"{name}={identity[name]}\n" for name in sorted(identity))
    return f"{kind}\n{fields}".encode()


# A site's report to the aggregation: what of its task's XCom summary only the aggregation may
# read (other sites' sample counts, metrics and privacy spent are none of a site's business).
REPORT_KEY = "report"
REPORT_FIELDS = ("num_samples", "metrics", "privacy", "signed")


def report_context(job: str, run_id: str, round_num: int, site: str) -> bytes:
    """What a site's sealed report is bound to: it opens for this (job, run, round, site) only, so
    a report copied into another site's or round's XCom does not open."""
    return seal_context("site-report", job=job, run_id=run_id, round=round_num, site=site)


def site_metrics_context(job: str, run_id: str, round_num: int) -> bytes:
    """What a round's sealed per-site metrics (the aggregation's XCom) are bound to: this (job, run, round)."""
    return seal_context("site-metrics", job=job, run_id=run_id, round=round_num)


def links_context(job: str, run_id: str, round_num: int, site: str) -> bytes:
    """What a site's sealed store links are bound to: they open for this (job, run, round, site) only."""
    return seal_context("store-links", job=job, run_id=run_id, round=round_num, site=site)


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _key(shared: bytes, ephemeral: bytes, recipient: bytes, context: bytes) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=ephemeral + recipient, info=_INFO + context)
    return hkdf.derive(shared)


def seal(recipient: X25519PublicKey, kid: str, plaintext: bytes, *, context: bytes) -> str:
    """``plaintext`` sealed to the box key ``recipient`` (key id ``kid``) for ``context``."""
    ephemeral = X25519PrivateKey.generate()
    eph_raw, rec_raw = _raw(ephemeral.public_key()), _raw(recipient)
    key = _key(ephemeral.exchange(recipient), eph_raw, rec_raw, context)
    body = ChaCha20Poly1305(key).encrypt(_NONCE, plaintext, context)
    return f"{PREFIX}.{kid}.{b64url(eph_raw + body)}"


def sealed_kid(sealed: Any) -> str | None:
    """The key id a sealed message names (None when it is not one)."""
    if not isinstance(sealed, str) or not sealed.startswith(PREFIX + "."):
        return None
    parts = sealed.split(".")
    # A kid is "<party>.<thumbprint>": the text is prefix, party, thumbprint, body.
    return ".".join(parts[1:-1]) or None


def open_sealed(box_key: X25519PrivateKey, sealed: Any, *, context: bytes, what: str) -> bytes:
    """The plaintext of ``sealed``; :class:`SealedOpenError` when it is not for this key and context."""
    if not isinstance(sealed, str) or len(sealed) > MAX_SEALED_CHARS or sealed_kid(sealed) is None:
        raise SealedOpenError(f"{what} is not a sealed message (expected '{PREFIX}.<kid>.<data>')")
    kid = str(sealed_kid(sealed))
    own = key_id(kid.rsplit(".", 1)[0], box_key.public_key())
    if kid != own:
        raise SealedOpenError(
            f"{what} is sealed to key {kid}, not to this worker's box key {own} (another party's, or a rotated key)"
        )
    try:
        data = b64url_decode(sealed.rsplit(".", 1)[1])
    except ValueError:
        raise SealedOpenError(f"{what} is not valid base64url") from None
    if len(data) < 32 + 16:
        raise SealedOpenError(f"{what} is too short to be a sealed message")
    eph_raw, body = data[:32], data[32:]
    try:
        shared = box_key.exchange(X25519PublicKey.from_public_bytes(eph_raw))
        key = _key(shared, eph_raw, _raw(box_key.public_key()), context)
        return ChaCha20Poly1305(key).decrypt(_NONCE, body, context)
    except (InvalidTag, ValueError):
        raise SealedOpenError(
            f"{what} does not open for this context: sealed for another job, run, round or party, or changed in XCom"
        ) from None


def load_box_key(key_dir: Path, party: str) -> X25519PrivateKey:
    """``party``'s box (X25519) private key under a worker's key directory."""
    path = party_dir(key_dir, party) / BOX_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise KeyMissing(
            f"{party}: no box key at {path}; make the party's keys with `flare-airflow "
            f"{'central keygen' if party == 'central' else 'site keygen ' + party}` and enrol the public JWKS"
        ) from None
    except OSError as exc:
        raise KeyMissing(f"{party}: cannot read the box key {path}: {exc.strerror or exc}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise TrustError(f"{party}: {path} is not a PEM private key ({exc})") from None
    if not isinstance(key, X25519PrivateKey):
        raise TrustError(f"{party}: {path} is a {type(key).__name__}, not an X25519 box key")
    return key


def box_public(jwk: Mapping[str, Any]) -> X25519PublicKey:
    """The X25519 public key of a registry entry."""
    return X25519PublicKey.from_public_bytes(b64url_decode(str(jwk.get("x", ""))))
