"""AggregateOperator.execute with a real store and real FedAvg; the site summaries come from a fake TI."""

from __future__ import annotations

import numpy as np
import pytest
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.store import ModelStore
from flare_airflow.operators.aggregate import AggregateOperator
from tests.unit.airflow_layer import RUN_ID, FakeTI, context, make_job

SITES = {"site-1": "round_1.site-1", "site-2": "round_1.site-2", "site-3": "round_1.site-3"}


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path, min_clients=2, sites={site: {} for site in SITES})


def setup_round(job, updates: dict[str, float]) -> tuple[ModelStore, FakeTI]:
    """Round 0's global model, each site's update (all weights = value, 10 samples), and the XCom
    summaries the site tasks would have pushed (the sha256 each one accepted)."""
    store = ModelStore.from_uri(job.store)
    write_artifact(store.global_model(job.job, RUN_ID, 0), FLModel(params={"w": np.zeros(3, np.float32)}))
    ti = FakeTI()
    for site, value in updates.items():
        record = write_artifact(
            store.site_update(job.job, RUN_ID, 1, site),
            FLModel(params={"w": np.full(3, value, np.float32)}, meta={"num_samples": 10}),
        )
        ti.xcoms[(SITES[site], "return_value")] = {"sha256": record.sha256, "num_samples": 10}
    return store, ti


def operator(job) -> AggregateOperator:
    return AggregateOperator(task_id="global_model", job=job, round_num=1, site_task_ids=SITES)


def test_counts_exactly_the_updates_the_site_tasks_accepted(job) -> None:
    store, ti = setup_round(job, {"site-1": 1.0, "site-2": 3.0})
    # site-3's trainer wrote a file, but its task never vouched for it (no XCom): it must not count.
    write_artifact(
        store.site_update(job.job, RUN_ID, 1, "site-3"),
        FLModel(params={"w": np.full(3, 100.0, np.float32)}, meta={"num_samples": 10}),
    )
    summary = operator(job).execute(context(ti))
    assert summary["accepted"] == ["site-1", "site-2"]
    assert set(summary["rejected"]) == {"site-3"}
    assert summary["site_sha256"] == {s: ti.xcoms[(SITES[s], "return_value")]["sha256"] for s in ("site-1", "site-2")}
    params, record = read_artifact(store.global_model(job.job, RUN_ID, 1))
    np.testing.assert_allclose(params["w"], [2.0, 2.0, 2.0])
    assert record.sha256 == summary["sha256"]


def test_an_update_replaced_after_its_task_accepted_it_is_rejected(job) -> None:
    store, ti = setup_round(job, {"site-1": 1.0, "site-2": 3.0, "site-3": 5.0})
    write_artifact(
        store.site_update(job.job, RUN_ID, 1, "site-2"),
        FLModel(params={"w": np.full(3, 1e6, np.float32)}, meta={"num_samples": 10}),
    )
    summary = operator(job).execute(context(ti))
    assert summary["accepted"] == ["site-1", "site-3"]
    assert "site-2" in summary["rejected"]
    params, _ = read_artifact(store.global_model(job.job, RUN_ID, 1))
    np.testing.assert_allclose(params["w"], [3.0, 3.0, 3.0])


def test_fewer_valid_updates_than_min_clients_fails_the_round_and_writes_nothing(job) -> None:
    store, ti = setup_round(job, {"site-1": 1.0})
    ti.xcoms[(SITES["site-2"], "failure")] = "trainer exited with code 3"
    with pytest.raises(AirflowFailException) as info:
        operator(job).execute(context(ti))
    message = str(info.value)
    assert message.startswith("round 1 failed:")
    assert "site-2" in message and "trainer exited with code 3" in message
    assert "site-3" in message
    assert not store.global_model(job.job, RUN_ID, 1).exists()
