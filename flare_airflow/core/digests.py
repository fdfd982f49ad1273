"""The integrity digests an artifact record holds: sha256 (always) and BLAKE3 (when available).

sha256 is what records, XCom, the UI and ``latest.json`` have always named, and every record keeps
it. BLAKE3 (the ``blake3`` package: Rust bindings by the BLAKE3 authors, no dependencies of its own)
hashes 4-5x faster per core here and releases the GIL; the aggregation verifies it instead of
sha256 when the record has one, so the checksum stops bounding the aggregation's throughput.
Trainer images built with only numpy and safetensors lack ``blake3``: they write and verify sha256
alone, and their records simply carry no BLAKE3 digest.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any, Protocol

_blake3: ModuleType | None
try:
    import blake3 as _blake3
except ImportError:  # a trainer image with the Client API's minimal dependencies
    _blake3 = None

SHA256 = "sha256"
BLAKE3 = "blake3"
HEX_DIGEST = re.compile(r"^[0-9a-f]{64}\Z")  # both are 256-bit digests


class Hasher(Protocol):
    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...


def available() -> tuple[str, ...]:
    """The algorithms this environment can compute, sha256 first."""
    return (SHA256, BLAKE3) if _blake3 is not None else (SHA256,)


def new_hasher(algorithm: str) -> Hasher:
    factories: dict[str, Callable[[], Hasher]] = {SHA256: hashlib.sha256}
    if _blake3 is not None:
        factories[BLAKE3] = _blake3.blake3
    if algorithm not in factories:
        raise ValueError(f"digest algorithm {algorithm!r} is not available here (have {sorted(factories)})")
    return factories[algorithm]()


def digest_all(data: Any, algorithms: Iterable[str]) -> dict[str, str]:
    """Hex digests of ``data`` (bytes-like) with each algorithm."""
    out = {}
    for algorithm in algorithms:
        hasher = new_hasher(algorithm)
        hasher.update(data)
        out[algorithm] = hasher.hexdigest()
    return out


def verifiable(recorded: Mapping[str, str | None]) -> tuple[str, ...]:
    """Which of a record's digests this environment can check: sha256, plus BLAKE3 if both sides have it."""
    return tuple(a for a in available() if recorded.get(a))
