"""Typed errors of trust: each says which record, which party and key, and what to do."""

from __future__ import annotations

from flare_airflow.core.errors import FlareAirflowError


class TrustError(FlareAirflowError):
    """A record could not be trusted, or a key could not be made or loaded."""


class KeyMissing(TrustError):
    """A party's private key is not where its worker looks for it."""


class RegistryError(TrustError):
    """The consortium registry of public keys cannot be read or is malformed."""


class UnsignedRecord(TrustError):
    """A record that must be signed carries no signature."""


class UnknownSigner(TrustError):
    """A record is signed with a key id the registry does not list (never enrolled, or revoked)."""


class WrongSigner(TrustError):
    """A record is signed by a registered key of another party than the one it speaks for."""


class BadSignature(TrustError):
    """A record's signature does not verify: it was changed after it was signed, or forged."""


class RecordMismatch(TrustError):
    """A validly signed record is not the record expected here (another job, run, round, site, or digest)."""
