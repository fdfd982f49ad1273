"""Privacy maths: the exact GDP accountant, the site's filters, central DP's aggregation step."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from flare_airflow.core.aggregation.central_dp import central_dp_problem
from flare_airflow.core.aggregation.streaming import FedAvg
from flare_airflow.core.config.aggregator import aggregator_spec
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.model import ArtifactRecord, ParamsType
from flare_airflow.core.privacy.accountant import (
    composed_mu,
    epsilon_after,
    gdp_delta,
    gdp_epsilon,
    noise_multiplier_for,
    rounds_within_budget,
)
from flare_airflow.core.privacy.central import CentralDP, central_dp_round
from flare_airflow.core.privacy.filters import (
    ClipFilter,
    ExcludeVarsFilter,
    GaussianFilter,
    PercentileFilter,
    PrivacyRefused,
    apply_filters,
    l2_norm,
    noise_generator,
    noise_key,
)
from flare_airflow.core.privacy.plan import PrivacyPlan, release

DELTA = 1e-5
KEY = noise_key(b"site secret", "job", "manual__1", 3, "site-1")


# ---------------------------------------------------------------- accountant


@pytest.mark.parametrize(
    ("z", "rounds", "epsilon"),
    [(1.0, 1, 4.377), (1.0, 10, 17.857), (2.0, 10, 7.511), (2.0, 11, 7.955), (2.0, 12, 8.385)],
)
def test_epsilon_of_the_gaussian_mechanism_with_full_participation(z: float, rounds: int, epsilon: float) -> None:
    assert round(epsilon_after(z, rounds, DELTA), 3) == epsilon


def test_delta_closed_form() -> None:
    assert gdp_delta(1.0, 1.0) == pytest.approx(0.1269367, abs=5e-8)
    # the root found is the ε whose δ is the job's δ
    assert gdp_delta(epsilon_after(2.0, 10, DELTA), composed_mu(2.0, 10)) == pytest.approx(DELTA, rel=1e-9)


def rdp_epsilon(z: float, rounds: int, delta: float) -> float:
    """The RDP account of the same mechanism (Mironov 2017; conversion of Canonne, Kamath & Steinke 2020)."""
    best = math.inf
    for alpha in np.geomspace(1.001, 2000, 3000):
        rdp = rounds * alpha / (2 * z * z)
        eps = rdp + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)
        best = min(best, eps)
    return best


@pytest.mark.parametrize(("z", "rounds"), [(1.0, 1), (1.0, 10), (2.0, 10), (0.8, 50), (4.0, 100)])
def test_the_exact_account_is_never_above_the_rdp_bound_and_close_to_it(z: float, rounds: int) -> None:
    exact, rdp = epsilon_after(z, rounds, DELTA), rdp_epsilon(z, rounds, DELTA)
    assert exact <= rdp
    assert rdp <= 1.25 * exact  # the same mechanism: the RDP conversion's slack is small, not a different curve


def test_budget_allows_eleven_rounds_at_z2_and_max_epsilon_8() -> None:
    assert rounds_within_budget(2.0, DELTA, 8.0, 50) == 11
    assert rounds_within_budget(2.0, DELTA, 8.0, 5) == 5


def test_choosing_z_from_a_target_epsilon() -> None:
    z = noise_multiplier_for(8.0, DELTA, 10)
    assert epsilon_after(z, 10, DELTA) <= 8.0
    assert epsilon_after(z * 0.999, 10, DELTA) > 8.0  # the smallest such z
    with pytest.raises(ConfigError, match="target epsilon"):
        noise_multiplier_for(0.0, DELTA, 10)


def test_edge_cases_of_the_account() -> None:
    assert epsilon_after(1.0, 0, DELTA) == 0.0
    assert gdp_epsilon(math.inf, DELTA) == math.inf
    with pytest.raises(ConfigError, match="delta"):
        gdp_epsilon(1.0, 0.0)


# ---------------------------------------------------------------- filters

GLOBAL = {
    "w": np.ones((4, 5), np.float32),
    "b": np.linspace(-1, 1, 5, dtype=np.float32) / 3,
    "steps": np.array(7, np.int64),
}


def update(scale: float, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": (GLOBAL["w"] + scale * rng.standard_normal((4, 5))).astype(np.float32),
        "b": (scale * rng.standard_normal(5)).astype(np.float32),
        "steps": np.array(9, np.int64),
    }


def diff_of(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: params[k].astype(np.float64) - GLOBAL[k].astype(np.float64) for k in ("w", "b")}


def test_clip_bounds_the_norm_of_the_difference() -> None:
    sent = update(10.0)
    assert l2_norm(diff_of(sent)) > 5
    out = apply_filters(
        sent, GLOBAL, diff_update=False, steps=[ClipFilter(clip=1.0)], key=None, public_tensors=["steps"]
    )
    assert l2_norm(diff_of(out.params)) <= 1.0 * (1 + 1e-6)
    assert out.params["steps"] is sent["steps"]
    assert {k: v.dtype for k, v in out.params.items()} == {k: v.dtype for k, v in sent.items()}


def test_an_update_inside_the_clip_is_bit_identical() -> None:
    sent = update(0.01)
    out = apply_filters(
        sent, GLOBAL, diff_update=False, steps=[ClipFilter(clip=10.0)], key=None, public_tensors=["steps"]
    )
    assert not out.changed
    assert all(out.params[k].tobytes() == sent[k].tobytes() for k in sent)


def test_gaussian_noise_has_the_calibrated_sd_and_mean() -> None:
    n, z, c = 1_000_000, 1.5, 0.5
    zero = {"x": np.zeros(n, np.float64)}
    out = apply_filters(
        zero,
        {"x": np.zeros(n)},
        diff_update=True,
        steps=[GaussianFilter(clip=c, noise_multiplier=z)],
        key=KEY,
    )
    noise = out.params["x"]
    assert abs(noise.std() - z * c) <= 0.01 * z * c
    assert abs(noise.mean()) <= 5 * z * c / math.sqrt(n)


def test_same_key_same_noise_other_key_other_noise() -> None:
    def noise(key: bytes) -> np.ndarray:
        return noise_generator(key, 0).standard_normal(1000)

    assert noise(KEY).tobytes() == noise(noise_key(b"site secret", "job", "manual__1", 3, "site-1")).tobytes()
    for other in (
        noise_key(b"site secret", "job", "manual__1", 4, "site-1"),  # another round
        noise_key(b"site secret", "job", "manual__1", 3, "site-2"),  # another site
        noise_key(b"site secret", "job", "manual__2", 3, "site-1"),  # another run
        noise_key(b"other secret", "job", "manual__1", 3, "site-1"),  # another site's secret
    ):
        assert not np.array_equal(noise(KEY), noise(other))
    assert not np.array_equal(noise_generator(KEY, 0).standard_normal(10), noise_generator(KEY, 1).standard_normal(10))


def test_percentile_is_nvflares_heuristic() -> None:
    out = apply_filters(
        {"d": np.array([0.1, -0.2, 0.6, -0.9])},
        {"d": np.zeros(4)},
        diff_update=True,
        steps=[PercentileFilter(percentile=50, gamma=0.5)],
        key=None,
    )
    assert out.params["d"].tolist() == [0.0, 0.0, 0.5, -0.5]


def record(num_samples: int, params_type: ParamsType = ParamsType.FULL) -> ArtifactRecord:
    return ArtifactRecord("0" * 64, 0, params_type, num_samples, {}, {}, {})


def test_exclude_vars_keeps_the_previous_global_values_in_the_aggregate() -> None:
    steps = [ExcludeVarsFilter(names=["b"], regex="st.*")]
    agg = FedAvg(GLOBAL, min_clients=2)
    for site, seed, samples, diff_update in (("a", 1, 10, False), ("b", 2, 30, True)):
        sent = update(1.0, seed)
        if diff_update:
            sent = {k: (v - GLOBAL[k]).astype(v.dtype) for k, v in sent.items()}
        out = apply_filters(sent, GLOBAL, diff_update=diff_update, steps=steps, key=None)
        assert out.excluded == ["b", "steps"]
        kind = ParamsType.DIFF if diff_update else ParamsType.FULL
        agg.add(site, out.params, record(samples, kind))
    result = agg.result().params
    assert result["b"].tobytes() == GLOBAL["b"].tobytes()
    assert result["steps"].tobytes() == GLOBAL["steps"].tobytes()
    assert not np.array_equal(result["w"], GLOBAL["w"])


# FFA-LoRA's shape: A frozen at the shared initialisation, only B trained.
LORA_GLOBAL = {
    "m.lora_A.weight": np.linspace(-0.5, 0.5, 12, dtype=np.float32).reshape(3, 4),
    "m.lora_B.weight": np.zeros((4, 3), np.float32),
}


@pytest.mark.parametrize("diff_update", [False, True])
def test_under_ffa_lora_the_filters_noise_only_b_and_the_strategy_accepts_it(diff_update: bool) -> None:
    rng = np.random.default_rng(5)
    trained_b = (3.0 * rng.standard_normal((4, 3))).astype(np.float32)
    sent = {"m.lora_A.weight": LORA_GLOBAL["m.lora_A.weight"].copy(), "m.lora_B.weight": trained_b}
    if diff_update:
        sent = {k: (v - LORA_GLOBAL[k]).astype(np.float32) for k, v in sent.items()}
    steps = [GaussianFilter(clip=1.0, noise_multiplier=0.5)]
    out = apply_filters(sent, LORA_GLOBAL, diff_update=diff_update, steps=steps, key=KEY, frozen=["*lora_A*"])
    assert out.params["m.lora_A.weight"].tobytes() == sent["m.lora_A.weight"].tobytes()  # bit for bit, unnoised
    b_diff = out.params["m.lora_B.weight"].astype(np.float64) - (0 if diff_update else LORA_GLOBAL["m.lora_B.weight"])
    assert out.applied[0]["norm"] == pytest.approx(float(np.linalg.norm(trained_b.astype(np.float64))))
    assert not np.allclose(b_diff, trained_b / np.linalg.norm(trained_b), atol=0.05)  # clipped to 1, then noised
    kind = ParamsType.DIFF if diff_update else ParamsType.FULL
    agg = aggregator_spec({"name": "ffa_lora"}).strategy().rule.start(LORA_GLOBAL, min_clients=1, site_weights={})
    agg.add("site-1", out.params, record(10, kind))
    assert list(agg.tally.accepted) == ["site-1"], agg.tally.rejected
    # Without the strategy's frozen names the noise reaches A too, and FFA-LoRA refuses the site (the old limit).
    unaware = apply_filters(sent, LORA_GLOBAL, diff_update=diff_update, steps=steps, key=KEY)
    agg = aggregator_spec({"name": "ffa_lora"}).strategy().rule.start(LORA_GLOBAL, min_clients=1, site_weights={})
    agg.add("site-1", unaware.params, record(10, kind))
    assert "'m.lora_A.weight' differs" in agg.tally.rejected["site-1"]


@pytest.mark.parametrize("diff_update", [False, True])
def test_a_frozen_tensor_the_trainer_moved_is_refused_at_the_site(diff_update: bool) -> None:
    sent = {
        "m.lora_A.weight": LORA_GLOBAL["m.lora_A.weight"] + np.float32(1e-3),
        "m.lora_B.weight": np.ones((4, 3), np.float32),
    }
    if diff_update:
        sent = {k: (v - LORA_GLOBAL[k]).astype(np.float32) for k, v in sent.items()}
    # Clip alone too: outside the filters a moved A would leave unclipped, so it never leaves.
    for steps in ([GaussianFilter(clip=1.0, noise_multiplier=0.5)], [ClipFilter(clip=1.0)]):
        with pytest.raises(
            PrivacyRefused, match=r"'m.lora_A.weight' differs .* keeps it frozen \(patterns '\*lora_A\*'\)"
        ):
            apply_filters(sent, LORA_GLOBAL, diff_update=diff_update, steps=steps, key=KEY, frozen=["*lora_A*"])


def test_private_non_float_tensors_and_metrics_are_refused() -> None:
    with pytest.raises(PrivacyRefused, match="'steps' are not floating-point"):
        apply_filters(update(1.0), GLOBAL, diff_update=False, steps=[ClipFilter(clip=1.0)], key=None)
    plan = PrivacyPlan(filters=[{"type": "clip", "clip": 1.0}], public_metrics=["loss"], public_tensors=["steps"])
    kwargs = {"diff_update": False, "round_num": 1, "key": None, "where": "site a round 1"}
    with pytest.raises(PrivacyRefused, match="metric\\(s\\) 'ids' are not declared public"):
        release(plan, update(1.0), GLOBAL, metrics={"loss": 0.1, "ids": 3.0}, meta={}, **kwargs)
    with pytest.raises(PrivacyRefused, match="meta key\\(s\\) 'host'"):
        release(plan, update(1.0), GLOBAL, metrics={"loss": 0.1}, meta={"host": "x"}, **kwargs)
    out = release(plan, update(1.0), GLOBAL, metrics={"loss": 0.1}, meta={}, **kwargs)
    assert out.metrics == {"loss": 0.1} and out.report["filters"][0]["scaled"]


def test_logged_metrics_leave_by_their_names_in_public_metrics() -> None:
    """Issue 37 #3: flare.log_metric's points travel in meta['tracked_metrics']; a site that made
    its metrics public had every update refused for that meta key."""
    plan = PrivacyPlan(public_metrics=["loss", "epoch_loss"], public_tensors=["steps"])
    kwargs = {"diff_update": False, "round_num": 1, "key": None, "where": "site a round 1"}
    logged = {"tracked_metrics": [["epoch_loss", 0.5, 1], ["epoch_loss", 0.4, 2]]}
    out = release(plan, update(1.0), GLOBAL, metrics={"loss": 0.1}, meta=logged, **kwargs)
    assert out.meta == logged
    with pytest.raises(
        PrivacyRefused, match=re.escape("logged metric(s) 'grad_norm' (flare.log_metric) are not declared")
    ):
        meta = {"tracked_metrics": [["epoch_loss", 0.5, 1], ["grad_norm", 3.0, 1]]}
        release(plan, update(1.0), GLOBAL, metrics={}, meta=meta, **kwargs)
    with pytest.raises(PrivacyRefused, match="malformed: 'epoch_loss': value is not a finite number"):
        release(plan, update(1.0), GLOBAL, metrics={}, meta={"tracked_metrics": [["epoch_loss", "id 42", 1]]}, **kwargs)


def test_noise_needs_its_key() -> None:
    with pytest.raises(PrivacyRefused, match="no noise key"):
        apply_filters(
            {"x": np.zeros(3)},
            {"x": np.zeros(3)},
            diff_update=True,
            steps=[GaussianFilter(clip=1.0, noise_multiplier=1.0)],
            key=None,
        )


# ---------------------------------------------------------------- central DP


def test_central_dp_clips_each_update_and_divides_the_noisy_sum_by_the_job_sites() -> None:
    glob = {"x": np.zeros(200_000), "n": np.array(3, np.int64)}
    big = {"x": np.full(200_000, 5.0), "n": np.array(99, np.int64)}
    small = {"x": np.full(200_000, 1e-4), "n": np.array(1, np.int64)}
    # 2 of the job's 4 sites arrive: the denominator stays 4, each update counts at most C.
    out = central_dp_round(
        glob, [("a", big, True), ("b", small, True)], clip=1.0, noise_multiplier=2.0, num_sites=4, key=KEY
    )
    clipped_sum = 1.0 / math.sqrt(200_000) + 1e-4
    noise = out["x"] * 4 - clipped_sum
    assert abs(noise.std() - 2.0) < 0.02 * 2.0
    assert abs(noise.mean()) < 5 * 2.0 / math.sqrt(200_000)
    assert out["n"] == 3  # non-float tensors keep the global value
    again = central_dp_round(
        glob, [("a", big, True), ("b", small, True)], clip=1.0, noise_multiplier=2.0, num_sites=4, key=KEY
    )
    assert again["x"].tobytes() == out["x"].tobytes()  # a retried aggregation releases the same bytes
    agg = CentralDP(glob, clip=1.0, noise_multiplier=2.0, num_sites=4, key=KEY)
    agg.add("a", big, diff_update=True)
    assert agg.norms["a"] == pytest.approx(5.0 * math.sqrt(200_000))


def test_central_dp_refuses_robust_rules() -> None:
    for rule, params in (("median", {}), ("trimmed_mean", {"beta": 0.2}), ("krum", {"f": 1})):
        strategy = aggregator_spec({"name": rule, **params}).strategy()
        assert f"robust aggregation rule '{rule}'" in (central_dp_problem(strategy) or "")
    assert central_dp_problem(aggregator_spec({"name": "fedavg"}).strategy()) is None
