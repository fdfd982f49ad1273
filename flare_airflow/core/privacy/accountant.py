"""The privacy account of the Gaussian mechanism with full participation, in Gaussian DP.

A round in which every site's update is clipped to L2 norm ``C`` and released with
N(0, (zC)²) noise on each coordinate is ``μ``-GDP with ``μ = 1/z`` for adding or removing one
site's data (the update's sensitivity is the clip norm, never a parameter). T such rounds compose
exactly to ``μ_T = sqrt(T)/z`` (Dong, Roth & Su, "Gaussian Differential Privacy", 2019/2022,
Corollary 3.3), and a μ-GDP mechanism is (ε, δ(ε))-DP for every ε ≥ 0 with the closed form
(their Corollary 2.13)::

    δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2)

ε at the job's δ is the root of that decreasing function, found by bisection. Unlike an RDP or
moments accountant this is the mechanism's exact (ε, δ) curve, not an upper bound: the tests
check that the RDP bound is never below it. Pure Python (``math.erfc``), no SciPy: the account
is kept by the run's tasks, which may run in a minimal environment.
"""

from __future__ import annotations

import math

from flare_airflow.core.errors import ConfigError

_BISECTIONS = 200  # far more than float64 needs: the loop stops when the bracket stops shrinking
_MAX_EPSILON = 700.0  # e^ε overflows a float64 a little above 709: beyond this ε is reported as inf


def _phi(x: float) -> float:
    """The standard normal CDF; erfc keeps its relative precision deep in the lower tail."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of a μ-GDP mechanism (Dong, Roth & Su, Corollary 2.13)."""
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    return max(0.0, _phi(-epsilon / mu + mu / 2) - math.exp(epsilon) * _phi(-epsilon / mu - mu / 2))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` for a μ-GDP mechanism (``inf`` when there is none)."""
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta!r}")
    if mu <= 0:
        return 0.0
    if math.isinf(mu) or math.isnan(mu):
        return math.inf
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while gdp_delta(high, mu) > delta:
        low, high = high, high * 2
        if high > _MAX_EPSILON:
            return math.inf
    for _ in range(_BISECTIONS):
        mid = (low + high) / 2
        if mid in (low, high):
            break
        if gdp_delta(mid, mu) > delta:
            low = mid
        else:
            high = mid
    return high


def composed_mu(noise_multiplier: float, rounds: int) -> float:
    """μ after ``rounds`` rounds of noise multiplier z, every site in every round: sqrt(T)/z."""
    if rounds < 0:
        raise ConfigError(f"rounds must be >= 0, got {rounds}")
    if noise_multiplier <= 0:
        return math.inf
    return math.sqrt(rounds) / noise_multiplier


def epsilon_after(noise_multiplier: float, rounds: int, delta: float) -> float:
    """ε at ``delta`` after ``rounds`` rounds of the Gaussian mechanism with noise multiplier z."""
    return gdp_epsilon(composed_mu(noise_multiplier, rounds), delta)


def rounds_within_budget(noise_multiplier: float, delta: float, max_epsilon: float, max_rounds: int) -> int:
    """The most rounds (at most ``max_rounds``) whose ε at ``delta`` stays within ``max_epsilon``."""
    allowed = 0
    for t in range(1, max_rounds + 1):  # ε grows with t: stop at the first round beyond the budget
        if epsilon_after(noise_multiplier, t, delta) > max_epsilon:
            break
        allowed = t
    return allowed


def noise_multiplier_for(target_epsilon: float, delta: float, rounds: int) -> float:
    """The smallest noise multiplier z whose ε at ``delta`` after ``rounds`` rounds is ≤ ``target_epsilon``.

    For a site admin or job author picking z: ``noise_multiplier_for(8, 1e-5, 10)`` is the z that
    spends ε = 8 in 10 rounds. ε(μ) increases with μ = sqrt(T)/z, so the μ that spends exactly the
    target is found by bisection and z = sqrt(T)/μ.
    """
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError(f"the target epsilon must be a positive number, got {target_epsilon!r}")
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    low, high = 0.0, 1.0
    while gdp_epsilon(high, delta) <= target_epsilon:
        low, high = high, high * 2
    for _ in range(_BISECTIONS):
        mid = (low + high) / 2
        if mid in (low, high):
            break
        if gdp_epsilon(mid, delta) <= target_epsilon:
            low = mid
        else:
            high = mid
    return math.sqrt(rounds) / low
