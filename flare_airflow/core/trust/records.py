"""Signed records: what a site says about its update, what the central side says about a global model.

A signed record is ``{"payload": {...}, "kid": ..., "sig": ...}``: an Ed25519 signature over a
domain tag (``update`` or ``global``, so one kind is never taken for the other) and the payload's
canonical JSON. It signs the record that already carries the artifact's digests, so verifying costs
one signature check and no second hash of the file (the reader checks the file by the digest once).
The payload binds the artifact to its identity -- (job, run, round, site) -- so a record copied
into another slot, or replayed from another round, no longer matches where it is used.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flare_airflow.core.trust.errors import BadSignature, RecordMismatch, UnsignedRecord, WrongSigner
from flare_airflow.core.trust.keys import b64url, b64url_decode
from flare_airflow.core.trust.registry import Registry

_DOMAINS = {
    "update": b"flare-airflow/update/v1\n",
    "global": b"flare-airflow/global/v1\n",
    "data": b"flare-airflow/data/v1\n",  # a site's data announcement (core/data_ready.py)
}


def _signed_bytes(payload: Mapping[str, Any]) -> bytes:
    kind = payload.get("type")
    if kind not in _DOMAINS:
        raise BadSignature(f"a signed record's type must be one of {sorted(_DOMAINS)}, got {kind!r}")
    # allow_nan: a privacy report may hold ε = inf; signer and verifier both write it as Infinity.
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return _DOMAINS[str(kind)] + text.encode()


def trainer_digest(argv: Sequence[str]) -> str:
    """sha256 of the exact argv the site ran: which trainer command made the update."""
    return hashlib.sha256(json.dumps(list(argv), separators=(",", ":")).encode()).hexdigest()


def update_payload(
    *,
    job: str,
    run_id: str,
    round_num: int,
    site: str,
    try_number: int | None,
    size: int,
    sha256: str,
    blake3: str | None,
    num_samples: int | None,
    params_type: str,
    privacy: Mapping[str, Any] | None,
    trainer: str,
) -> dict[str, Any]:
    """What a site signs about the update it published for (job, run, round, site)."""
    return {
        "type": "update",
        "job": job,
        "run_id": run_id,
        "round": round_num,
        "site": site,
        "try": try_number,
        "size": size,
        "sha256": sha256,
        "blake3": blake3,
        "num_samples": num_samples,
        "params_type": params_type,
        "privacy": dict(privacy) if privacy is not None else None,
        "trainer": trainer,
    }


def global_payload(
    *, job: str, run_id: str, round_num: int, size: int, sha256: str, blake3: str | None
) -> dict[str, Any]:
    """What the central side signs about the global model it published after ``round_num``."""
    return {
        "type": "global",
        "job": job,
        "run_id": run_id,
        "round": round_num,
        "size": size,
        "sha256": sha256,
        "blake3": blake3,
    }


def sign_record(payload: Mapping[str, Any], kid: str, key: Ed25519PrivateKey) -> dict[str, Any]:
    return {"payload": dict(payload), "kid": kid, "sig": b64url(key.sign(_signed_bytes(payload)))}


def verify_record(
    signed: Any, registry: Registry, *, party: str, expect: Mapping[str, Any], what: str
) -> dict[str, Any]:
    """The payload of ``signed`` once it is proven: signed by an enrolled key of ``party``, intact,
    and saying ``expect`` (each field equal). ``what`` names the record in the errors."""
    if not isinstance(signed, dict) or not signed.get("sig") or not isinstance(signed.get("payload"), dict):
        raise UnsignedRecord(f"{what} is not signed; its party must sign it with a key enrolled in {registry.where}")
    payload, kid = signed["payload"], str(signed.get("kid"))
    signer = registry.signer(kid)
    if signer.party != party:
        raise WrongSigner(f"{what} is signed with {signer.party!r}'s key {kid}, not by {party!r}")
    try:
        signer.public.verify(b64url_decode(str(signed["sig"])), _signed_bytes(payload))
    except (InvalidSignature, ValueError, TypeError):
        raise BadSignature(
            f"{what}: the signature of key {kid} does not match the record (changed or forged)"
        ) from None
    for field, value in expect.items():
        if payload.get(field) != value:
            raise RecordMismatch(
                f"{what}: its signed record says {field} {payload.get(field)!r}, expected {value!r} "
                "(a record copied from another slot, run or round, or an artifact changed after signing)"
            )
    return dict(payload)
