"""Central DP through the real store engine: safetensors updates in a temp store, verified reads,
clip each update, noise the sum, divide by the job's number of sites (whoever arrived)."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest

from flare_airflow.core.aggregation.central_dp import with_central_dp
from flare_airflow.core.aggregation.engine import aggregate_from_store
from flare_airflow.core.aggregation.strategies import Median, Strategy
from flare_airflow.core.config.aggregator import aggregator_spec
from flare_airflow.core.config.privacy import JobPrivacy
from flare_airflow.core.errors import FlareAirflowError, QuorumNotReached
from flare_airflow.core.model import FLModel, ParamsType, read_record, write_artifact
from flare_airflow.core.privacy.central import central_dp_round, central_noise_key
from tests.unit.core.aggregation.test_strategies import write_updates

SECRET = b"\x5a" * 32
KEY = central_noise_key(SECRET, "j", "run-1", 1)


def central(clip: float, z: float, num_sites: int, key: bytes = KEY) -> Strategy:
    return with_central_dp(aggregator_spec({}).strategy(), clip=clip, noise_multiplier=z, num_sites=num_sites, key=key)


def four_sites_two_arrived(tmp: pathlib.Path, updates: list[dict]) -> list:
    paths = write_updates(tmp, updates, [10] * len(updates))
    return paths + [(f"site-{i}", None, "the trainer crashed") for i in range(len(updates), 4)]


def test_the_denominator_is_the_jobs_number_of_sites_not_who_arrived(tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(3)
    glob = {"w": rng.standard_normal((8, 5)).astype(np.float32), "steps": np.array([7], np.int64)}
    ups = [{"w": glob["w"] + np.float32(0.01) * (i + 1), "steps": np.array([9], np.int64)} for i in range(2)]
    paths = four_sites_two_arrived(tmp_path, ups)
    outcome, state = aggregate_from_store(central(10.0, 1e-6, 4), glob, paths, min_clients=2)
    assert sorted(outcome.accepted) == ["site-0", "site-1"] and set(outcome.rejected) == {"site-2", "site-3"}
    assert state == {} and outcome.clipped == {}
    # (0.01 + 0.02) / 4 -- not / 2 (the sites that arrived) and not sample-weighted; noise sd 2.5e-6.
    np.testing.assert_allclose(outcome.params["w"] - glob["w"], 0.0075, atol=5e-5)
    assert outcome.params["steps"].tobytes() == glob["steps"].tobytes()  # not noised: the global's value
    # Bitwise the pure maths (core/privacy/central.py) on the same updates.
    pure = central_dp_round(
        glob, [(s, u, False) for s, u in zip(["site-0", "site-1"], ups, strict=True)],
        clip=10.0, noise_multiplier=1e-6, num_sites=4, key=KEY,
    )  # fmt: skip
    assert all(outcome.params[k].tobytes() == pure[k].tobytes() for k in glob)


def test_min_clients_still_applies(tmp_path: pathlib.Path) -> None:
    glob = {"w": np.zeros(4, np.float32)}
    paths = four_sites_two_arrived(tmp_path, [{"w": np.ones(4, np.float32)}] * 2)
    with pytest.raises(QuorumNotReached) as info:
        aggregate_from_store(central(1.0, 1.0, 4), glob, paths, min_clients=3)
    assert "min_clients is 3" in str(info.value) and "site-3: the trainer crashed" in str(info.value)


def test_clipping_bounds_each_contribution(tmp_path: pathlib.Path) -> None:
    glob = {"w": np.zeros(100, np.float32)}
    ups = [{"w": np.full(100, 100.0, np.float32)}, {"w": np.full(100, 0.01, np.float32)}]  # norms 1000 and 0.1
    outcome, _ = aggregate_from_store(central(1.0, 1e-6, 4), glob, four_sites_two_arrived(tmp_path, ups), min_clients=1)
    assert outcome.clipped == {"site-0": pytest.approx(1.0 / 1000.0)}  # site-1 is inside: not scaled
    released = outcome.params["w"].astype(np.float64)
    # site-0 contributes its direction at norm C = 1, site-1 itself: (0.1 + 0.01) / 4 per element.
    np.testing.assert_allclose(released, (0.1 + 0.01) / 4, atol=1e-5)


def test_diff_updates_are_clipped_as_differences(tmp_path: pathlib.Path) -> None:
    glob = {"w": np.full(4, 3.0, np.float32)}
    paths = write_updates(tmp_path, [{"w": np.full(4, 5.0, np.float32)}], [1], kind=ParamsType.DIFF)
    outcome, _ = aggregate_from_store(central(1.0, 1e-6, 2), glob, paths, min_clients=1)
    np.testing.assert_allclose(outcome.params["w"], 3.0 + 0.5 / 2, atol=1e-5)  # ||(5,5,5,5)|| = 10 -> 0.5 each


def test_noise_sd_is_z_clip_over_the_number_of_sites(tmp_path: pathlib.Path) -> None:
    n = 1_000_000
    glob = {"w": np.zeros(n, np.float32)}
    paths = four_sites_two_arrived(tmp_path, [{"w": np.zeros(n, np.float32)}] * 2)
    outcome, _ = aggregate_from_store(central(2.0, 1.0, 4), glob, paths, min_clients=2)
    noise = outcome.params["w"].astype(np.float64)
    sd = 1.0 * 2.0 / 4  # z C / n
    assert abs(noise.std() / sd - 1) < 0.01
    assert abs(noise.mean()) < 5 * sd / np.sqrt(n)


def test_same_key_same_bytes_another_round_other_noise(tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(5)
    glob = {"w": rng.standard_normal(1000).astype(np.float32)}
    paths = four_sites_two_arrived(tmp_path, [{"w": rng.standard_normal(1000).astype(np.float32)} for _ in range(2)])

    def release(key: bytes, name: str) -> str:
        outcome, _ = aggregate_from_store(central(1.0, 1.0, 4, key), glob, paths, min_clients=2)
        record = write_artifact(tmp_path / f"{name}.safetensors", FLModel(params=outcome.params))
        assert record.sha256 == hashlib.sha256((tmp_path / f"{name}.safetensors").read_bytes()).hexdigest()
        return record.sha256

    first = release(KEY, "first")
    assert release(KEY, "retry") == first  # a retried aggregation releases the same bytes
    assert release(central_noise_key(SECRET, "j", "run-1", 2), "round-2") != first
    assert release(central_noise_key(SECRET, "j", "run-2", 1), "run-2") != first
    assert release(central_noise_key(b"\x00" * 32, "j", "run-1", 1), "other-secret") != first


def test_updates_are_verified_as_fedavgs_are(tmp_path: pathlib.Path) -> None:
    glob = {"w": np.zeros(4, np.float32)}
    bad_nan = np.array([1, np.nan, 0, 0], np.float32)
    ups = [{"w": np.ones(4, np.float32)}, {"w": bad_nan}, {"w": np.ones(5, np.float32)}, {"w": np.ones(4, np.float32)}]
    paths = write_updates(tmp_path, ups, [1] * 4)
    pins = {site: read_record(path).sha256 for site, path, _ in paths}
    pins["site-0"] = "0" * 64  # the file is not the update its site task accepted
    outcome, _ = aggregate_from_store(central(1.0, 1.0, 4), glob, paths, min_clients=1, accepted_sha256=pins)
    assert list(outcome.accepted) == ["site-3"] and set(outcome.rejected) == {"site-0", "site-1", "site-2"}
    assert "is not the update its site task accepted" in outcome.rejected["site-0"]
    assert "site-3" not in outcome.rejected


def test_central_dp_refuses_a_robust_rule_or_a_norm_bound() -> None:
    with pytest.raises(FlareAirflowError, match="'median'"):
        with_central_dp(Strategy(rule=Median()), clip=1.0, noise_multiplier=1.0, num_sites=2, key=KEY)
    bounded = aggregator_spec({"norm_bound": 2.0}).strategy()
    with pytest.raises(FlareAirflowError, match="norm bound"):
        with_central_dp(bounded, clip=1.0, noise_multiplier=1.0, num_sites=2, key=KEY)


def test_the_central_account_and_budget() -> None:
    # mu = sqrt(T) / z from central DP alone; max_epsilon ends the run before the round that would exceed it.
    privacy = JobPrivacy.model_validate(
        {"central": {"clip": 1.0, "noise_multiplier": 2.0}, "delta": 1e-5, "max_epsilon": 8}
    )
    assert privacy.epsilon_after(11) == pytest.approx(7.955, abs=1e-3)
    assert privacy.rounds_allowed(20) == 11
    row = privacy.account(10)
    assert row is not None and row["epsilon"] == pytest.approx(7.511, abs=1e-3) and row["noise_multiplier"] == 2.0


def test_the_round_strategy_is_assembled_once_from_the_job_with_central_dp_around_it(tmp_path: pathlib.Path) -> None:
    from flare_airflow.core.aggregation.central_dp import CentralDPRule
    from tests.unit.airflow_layer import make_job

    asked: list[str] = []

    def key() -> bytes:
        asked.append("key")
        return b"k" * 32

    plain = make_job(tmp_path).round_strategy(key)
    assert plain.rule.name == "fedavg" and asked == []  # no central DP: the run's secret is never asked for
    job = make_job(tmp_path, privacy={"central": {"clip": 1.0, "noise_multiplier": 0.5}, "delta": 1e-5})
    rule = job.round_strategy(key).rule
    assert isinstance(rule, CentralDPRule) and asked == ["key"]
    assert (rule.clip, rule.noise_multiplier, rule.num_sites, rule.key) == (1.0, 0.5, 2, b"k" * 32)
