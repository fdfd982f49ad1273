"""The privacy account of the Gaussian mechanism with full participation, in Gaussian DP.

A round in which every site's update is clipped to L2 norm ``C`` and released with
N(0, (zC)²) noise on each coordinate is ``μ``-GDP with ``μ = 1/z`` for adding or removing one
site's data (the update's sensitivity is the clip norm, never a parameter). T such rounds compose
exactly to ``μ_T = sqrt(T)/z`` (Dong, Roth & Su, "Gaussian Differential Privacy", 2019/2022,
Corollary 3.3), and a μ-GDP mechanism is (ε, δ(ε))-DP for every ε ≥ 0 with the closed form
(their Corollary 2.13)::

    δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2)

ε at the job's δ is the root of that decreasing function, found by bisection; the second term is
computed as ``exp(ε + log Φ(·))`` with an asymptotic log Φ deep in the tail, so ε is finite for
every z > 0 a float can hold (a tiny z spends a huge ε, never an "inf" that no budget can compare). Unlike an RDP or
moments accountant this is the mechanism's exact (ε, δ) curve, not an upper bound: the tests
check that the RDP bound is never below it. Pure Python (``math.erfc``), no SciPy: the account
is kept by the run's tasks, which may run in a minimal environment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flare_airflow.core.errors import ConfigError

_BISECTIONS = 200  # far more than float64 needs: the loop stops when the bracket stops shrinking
_MAX_EPSILON = 1e15  # the doubling search gives up (ε = inf) only beyond this: a z below ~1e-7
_LOG_PHI_TAIL = -37.0  # below this Φ underflows in erfc: the asymptotic series is exact to float precision


def _phi(x: float) -> float:
    """The standard normal CDF; erfc keeps its relative precision deep in the lower tail."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _log_phi(x: float) -> float:
    """log Φ(x), also where Φ(x) underflows (Mills-ratio series, x < -37)."""
    if x >= _LOG_PHI_TAIL:
        return math.log(_phi(x))
    r = 1.0 / (x * x)
    return -x * x / 2 - math.log(-x) - 0.5 * math.log(2 * math.pi) + math.log1p(-r + 3 * r * r - 15 * r * r * r)


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of a μ-GDP mechanism (Dong, Roth & Su, Corollary 2.13)."""
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    second = math.exp(epsilon + _log_phi(-epsilon / mu - mu / 2))  # e^ε Φ(·) without overflowing e^ε
    return max(0.0, _phi(-epsilon / mu + mu / 2) - second)


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


def composed_mu_of(mus: Sequence[float]) -> float:
    """μ of the composition of releases of μ₁, μ₂, ... GDP: sqrt(Σ μᵢ²) (Dong, Roth & Su,
    Corollary 3.3): exact, so every distinct release is charged and nothing more."""
    return math.sqrt(math.fsum(m * m for m in mus))


def epsilon_of_releases(mus: Sequence[float], delta: float) -> float:
    """ε at ``delta`` of the releases ``mus`` (each μᵢ = 1/zᵢ), composed exactly."""
    return gdp_epsilon(composed_mu_of(mus), delta)


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
