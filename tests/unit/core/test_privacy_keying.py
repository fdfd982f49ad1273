"""Attacks on the noise's keying: two releases of one (job, run, round, site) -- or of one round's
central sum -- must not cancel each other's noise (issue 34). Same update republished: same bytes;
another update or another set: independent noise, checked by the variance of what is left."""

from __future__ import annotations

import math

import numpy as np

from flare_airflow.core.privacy.central import central_dp_round, central_noise_key
from flare_airflow.core.privacy.filters import GaussianFilter, apply_filters, noise_key

N = 200_000
Z, C = 1.0, 1.0
KEY = noise_key(b"s" * 32, "job", "manual__1", 3, "site-1")
GLOBAL = {"x": np.zeros(N, np.float32)}


def _release(sent: dict[str, np.ndarray], z: float = Z) -> tuple[np.ndarray, str | None]:
    out = apply_filters(
        sent,
        GLOBAL,
        diff_update=False,
        steps=[GaussianFilter(clip=C, noise_multiplier=z)],
        key=KEY,
    )
    return out.params["x"].astype(np.float64), out.release_id


def _update(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal(N).astype(np.float32)}


def _clipped(sent: dict[str, np.ndarray]) -> np.ndarray:
    x = sent["x"].astype(np.float64)
    return x * min(1.0, C / float(np.linalg.norm(x)))


def _is_fresh_noise(residual: np.ndarray, sd: float) -> bool:
    """``residual`` is the difference of two independent N(0, sd²) draws: variance 2sd² (±3%, about
    9 standard errors at this N), not ~0 as when the two noises cancel."""
    return abs(residual.var() / (2 * sd * sd) - 1) < 0.03


def test_a_retry_that_sends_the_same_update_republishes_the_same_bytes() -> None:
    first, id1 = _release(_update(1))
    again, id2 = _release(_update(1))
    assert first.tobytes() == again.tobytes()
    assert id1 == id2 and id1 is not None


def test_a_hostile_retry_sending_the_global_model_back_does_not_reveal_the_update() -> None:
    # Try 1 releases the site's real update; try 2 (hostile trainer) sends the global model back.
    # Keyed by (job, run, round, site) alone, release1 - release2 was the clipped update to ~1e-7.
    sent = _update(1)
    first, id1 = _release(sent)
    second, id2 = _release({"x": GLOBAL["x"].copy()})
    residual = (first - second) - _clipped(sent)
    assert _is_fresh_noise(residual, Z * C), residual.var()
    assert id1 != id2  # two releases: the ledger charges both


def test_two_different_honest_updates_get_independent_noise() -> None:
    a, b = _update(1), _update(2)
    ra, _ = _release(a)
    rb, _ = _release(b)
    assert _is_fresh_noise((ra - rb) - (_clipped(a) - _clipped(b)), Z * C)


def test_the_same_update_under_two_noise_multipliers_does_not_cancel_the_noise() -> None:
    # With one noise n for both: r1 = u + z1·n, r2 = u + z2·n, and (z2·r1 - z1·r2)/(z2 - z1) = u.
    sent = _update(1)
    r1, _ = _release(sent, 1.0)
    r2, _ = _release(sent, 2.0)
    recovered = (2.0 * r1 - 1.0 * r2) / (2.0 - 1.0)
    residual = recovered - _clipped(sent)
    # (2·n1 - n2) with n1 ~ N(0, 1), n2 ~ N(0, 4) independent: variance 8, not ~0.
    assert abs(residual.var() / 8.0 - 1) < 0.03, residual.var()


def test_central_noise_for_another_accepted_set_is_independent() -> None:
    # A round aggregated with site b failed, then again after b was cleared and succeeded: keyed by
    # the round alone, global(after) - global(before) was b's clipped update / n, with no noise.
    glob = {"x": np.zeros(N)}
    a, b = {"x": np.full(N, 0.5 / math.sqrt(N))}, {"x": np.full(N, 0.7 / math.sqrt(N))}
    key = central_noise_key(b"c" * 32, "job", "manual__1", 2)
    before = central_dp_round(glob, [("a", a, True)], clip=C, noise_multiplier=Z, num_sites=2, key=key)["x"]
    after = central_dp_round(glob, [("a", a, True), ("b", b, True)], clip=C, noise_multiplier=Z, num_sites=2, key=key)
    residual = (after["x"] - before) - b["x"] / 2
    assert _is_fresh_noise(residual, Z * C / 2), residual.var()
    again = central_dp_round(glob, [("b", b, True), ("a", a, True)], clip=C, noise_multiplier=Z, num_sites=2, key=key)
    assert again["x"].tobytes() == after["x"].tobytes()  # the same set, in any order: the same bytes
