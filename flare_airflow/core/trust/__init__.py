"""Trust between participants: party keys, the consortium registry, signed records (issue 36).

Pure core code (``cryptography`` only, no Airflow): :mod:`.keys` makes and loads a party's keys,
:mod:`.registry` reads the consortium's public keys, :mod:`.records` signs and verifies the records
that cross a boundary (a site's update record, the central side's global record).
See docs/threat-model.md.
"""

from flare_airflow.core.trust.errors import (
    BadSignature,
    KeyMissing,
    RecordMismatch,
    RegistryError,
    TrustError,
    UnknownSigner,
    UnsignedRecord,
    WrongSigner,
)
from flare_airflow.core.trust.keys import CENTRAL, PartyKeys, generate_keys, load_signing_key
from flare_airflow.core.trust.records import global_payload, sign_record, update_payload, verify_record
from flare_airflow.core.trust.registry import Registry, SignerKey

__all__ = [
    "CENTRAL",
    "BadSignature",
    "KeyMissing",
    "PartyKeys",
    "RecordMismatch",
    "Registry",
    "RegistryError",
    "SignerKey",
    "TrustError",
    "UnknownSigner",
    "UnsignedRecord",
    "WrongSigner",
    "generate_keys",
    "global_payload",
    "load_signing_key",
    "sign_record",
    "update_payload",
    "verify_record",
]
