"""How strong a noise secret is: refuse one an attacker could guess, and say how to make one.

Whoever guesses the secret regenerates -- and subtracts -- the noise, so the secret's entropy
bounds the whole guarantee. A string's entropy cannot be measured; its estimate here is its
length times the empirical Shannon entropy of its characters, which is generous (never below
what a random string of that alphabet has in expectation, far above a word's): a one-character
secret, ``"5e" * 32`` (64 bits) or a passphrase-length word fail, ``secrets.token_hex(32)``
(≈ 240 bits by this estimate) passes.
"""

from __future__ import annotations

import math
from collections import Counter

MIN_SECRET_BITS = 128
MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(32))'"


def estimated_bits(value: str) -> float:
    """Length x the empirical entropy (bits per character) of ``value``."""
    if not value:
        return 0.0
    counts = Counter(value)
    n = len(value)
    per_char = max(0.0, -sum(c / n * math.log2(c / n) for c in counts.values()))
    return n * per_char


def weak_secret_problem(value: str, variable: str) -> str | None:
    """Why the secret in Airflow variable ``variable`` is too weak, or None. Never quotes the value."""
    bits = estimated_bits(value)
    if bits >= MIN_SECRET_BITS:
        return None
    return (
        f"the noise secret in the Airflow variable {variable!r} is too weak: about {bits:.0f} bits of entropy "
        f"({len(value)} characters), below the {MIN_SECRET_BITS} bits that keep the noise from being guessed and "
        f'subtracted; replace it with 32 random bytes as hex: airflow variables set {variable} "$({MAKE_ONE})"'
    )
