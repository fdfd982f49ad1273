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


def set_on_site_worker(variable: str) -> str:
    """How a site admin sets the site's secret ``variable``: in the worker's own environment.

    Never ``airflow variables set``: a site worker has no metadata database, and a value put in the
    central one would be the central side's to read (and, in strict mode, is refused to site tasks).
    """
    return (
        f'set AIRFLOW_VAR_{variable.upper()}="$({MAKE_ONE})" in the environment of the site\'s worker '
        "(or its own secrets backend) and restart the worker"
    )


def estimated_bits(value: str) -> float:
    """Length x the empirical entropy (bits per character) of ``value``."""
    if not value:
        return 0.0
    counts = Counter(value)
    n = len(value)
    per_char = max(0.0, -sum(c / n * math.log2(c / n) for c in counts.values()))
    return n * per_char


def weak_secret_problem(value: str, variable: str, *, at_site: bool = True) -> str | None:
    """Why the secret in Airflow variable ``variable`` is too weak, or None. Never quotes the value.

    ``at_site``: a site's secret (set on the site's worker); else the central side's (set where
    the aggregation runs, which has the metadata database)."""
    bits = estimated_bits(value)
    if bits >= MIN_SECRET_BITS:
        return None
    return (
        f"the noise secret in the Airflow variable {variable!r} is too weak: about {bits:.0f} bits of entropy "
        f"({len(value)} characters), below the {MIN_SECRET_BITS} bits that keep the noise from being guessed and "
        "subtracted; replace it with 32 random bytes as hex: "
        + (set_on_site_worker(variable) if at_site else f'airflow variables set {variable} "$({MAKE_ONE})"')
    )
