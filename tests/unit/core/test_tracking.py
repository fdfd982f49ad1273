"""What a run reports to the tracker, as plain data: points per round and site, idempotent plans."""

from __future__ import annotations

import pytest

from flare_airflow.core.tracking import (
    MAX_TRACKED_POINTS,
    TRACKED_META_KEY,
    flat_params,
    merge_points,
    missing_points,
    round_points,
    run_key,
    site_points,
    tracked_points,
)

SUMMARY = {
    "round": 2,
    "accepted": ["site-1", "site-2"],
    "rejected": {"site-3": "NaN"},
    "num_samples": 300,
    "metrics": {"train_loss": 0.5, "train_accuracy": 0.8},
    "site_metrics": {"site-1": {"train_loss": 0.4}, "site-2": {"train_loss": 0.6, "odd": "text"}},
    "evaluation": {"accuracy": 0.9, "loss": 0.3},
    "privacy": {"epsilon": 1.5},
}


def test_round_points_name_global_mean_and_site_counts() -> None:
    assert round_points(SUMMARY) == {
        "global_accuracy": 0.9,
        "global_loss": 0.3,
        "mean_train_loss": 0.5,
        "mean_train_accuracy": 0.8,
        "privacy_epsilon": 1.5,
        "sites_valid": 2.0,
        "sites_rejected": 1.0,
        "num_samples": 300.0,
    }
    assert site_points(SUMMARY, "site-2") == {"train_loss": 0.6}  # a non-number is no metric
    assert site_points(SUMMARY, "site-3") == {}


def test_missing_points_log_each_step_once_and_report_other_values() -> None:
    wanted = {"acc": {1: 0.5, 2: 0.6, 3: 0.7}, "loss": {1: 1.0}}
    todo, differ = missing_points(wanted, {"acc": {1: 0.5, 2: 0.65}})
    assert todo == {"acc": {3: 0.7}, "loss": {1: 1.0}}
    assert differ == ["acc at step 2: logged 0.65, now 0.6"]
    assert missing_points(wanted, wanted) == ({}, [])


def test_tracked_points_are_checked_again_from_the_record() -> None:
    meta = {
        TRACKED_META_KEY: [
            ["epoch_loss", 0.5, 1],
            ["epoch_loss", 0.4, 2],
            ["bad name!", 1.0, 1],
            ["x", float("inf"), 1],
            ["y", 1.0, -3],
            "junk",
        ]
    }
    points, problems = tracked_points(meta)
    assert points == {"epoch_loss": {1: 0.5, 2: 0.4}}
    assert len(problems) == 4 and "entry 5 is not [name, value, step]" in problems
    assert tracked_points({}) == ({}, [])
    assert tracked_points({TRACKED_META_KEY: "x"})[1] == ["meta['tracked_metrics'] is not a list"]
    many, problems = tracked_points({TRACKED_META_KEY: [["k", 1.0, i] for i in range(MAX_TRACKED_POINTS + 5)]})
    assert len(many["k"]) == MAX_TRACKED_POINTS and problems == [f"5 points beyond the first {MAX_TRACKED_POINTS}"]


def test_merge_flat_params_and_run_key() -> None:
    assert merge_points({"a": {1: 1.0}}, {"a": {2: 2.0}, "b": {1: 0.0}}) == {"a": {1: 1.0, 2: 2.0}, "b": {1: 0.0}}
    assert flat_params({"strategy": {"name": "fedavg", "mu": 0.1}, "sites": ["a", "b"], "lr": 0.5}) == {
        "strategy.name": "fedavg",
        "strategy.mu": "0.1",
        "sites": "a,b",
        "lr": "0.5",
    }
    key = run_key("flare_digits", "manual__2026-01-01T00:00:00+00:00")
    assert len(key) == 32 and key == run_key("flare_digits", "manual__2026-01-01T00:00:00+00:00")
    assert key != run_key("flare_digits2", "manual__2026-01-01T00:00:00+00:00")


@pytest.mark.parametrize("value", [float("nan"), True, "0.1", None])
def test_non_numbers_are_not_points(value: object) -> None:
    assert round_points({"evaluation": {"accuracy": value}}) == {"sites_valid": 0.0, "sites_rejected": 0.0}
