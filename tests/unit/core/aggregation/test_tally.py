"""core/aggregation/tally.py: the one round tally every rule keeps (streaming FedAvg, the chunked rules, central DP)."""

from __future__ import annotations

import pytest

from flare_airflow.core.aggregation.tally import RoundTally, round_metrics
from flare_airflow.core.errors import FlareAirflowError, QuorumNotReached
from flare_airflow.core.model import MAX_METRICS, ArtifactRecord, ParamsType


def record(num_samples: int | None, **metrics: float) -> ArtifactRecord:
    return ArtifactRecord(
        sha256="0" * 64, size=0, params_type=ParamsType.FULL, num_samples=num_samples, metrics=metrics, meta={},
        tensors={},
    )  # fmt: skip


def test_metrics_weigh_by_samples_and_a_site_without_samples_counts_once() -> None:
    tally = RoundTally()
    tally.accept("a", record(3, loss=1.0), 6.0)
    tally.accept("b", record(None, loss=5.0, acc=0.5), 1.0)
    outcome = tally.outcome({})
    assert outcome.accepted == {"a": 6.0, "b": 1.0}
    assert outcome.metrics == {"acc": 0.5, "loss": (3 * 1.0 + 1 * 5.0) / 4}
    assert outcome.num_samples == 4
    assert outcome.site_metrics == {"a": {"loss": 1.0}, "b": {"loss": 5.0, "acc": 0.5}}


def test_a_site_counts_once_and_the_quorum_names_every_failed_site() -> None:
    tally = RoundTally()
    tally.accept("a", record(1), 1.0)
    tally.reject("b", "shape mismatch")
    for again in ("a", "b"):
        with pytest.raises(FlareAirflowError, match=f"site '{again}' already counted in this round"):
            tally.check_new(again)
    tally.check_quorum(1)
    with pytest.raises(QuorumNotReached, match=r"1 valid update\(s\) from \['a'\], min_clients is 2\. "
                       r"Failed sites: b: shape mismatch\."):  # fmt: skip
        tally.check_quorum(2)


def test_more_metric_names_than_a_record_holds_keep_those_reported_for_the_most_samples() -> None:
    sums = {f"m{i:03d}": float(i) for i in range(MAX_METRICS + 2)}
    weights = {name: 1.0 for name in sums} | {"m000": 5.0, "m001": 5.0}
    metrics, dropped = round_metrics(sums, weights)
    assert len(metrics) == MAX_METRICS and {"m000", "m001"} <= set(metrics)
    assert dropped == [f"m{MAX_METRICS:03d}", f"m{MAX_METRICS + 1:03d}"]
