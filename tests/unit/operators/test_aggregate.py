"""AggregateOperator.execute with a real store and real strategies; the site summaries come from a fake TI."""

from __future__ import annotations

import ast
import errno
import os
import pathlib

import numpy as np
import pytest
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.aggregation import round_output
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


def test_a_full_store_fails_the_round_saying_how_to_resume(job, monkeypatch: pytest.MonkeyPatch) -> None:
    store, ti = setup_round(job, {"site-1": 1.0, "site-2": 3.0})

    def full(path: object, model: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # Core raises RoundWriteError (tests/unit/core/aggregation/test_round_output.py); the task fails with its words.
    monkeypatch.setattr(round_output, "write_artifact", full)
    with pytest.raises(AirflowFailException) as info:
        operator(job).execute(context(ti))
    message = str(info.value)
    assert message.startswith("round 1: cannot write the global model ") and message.endswith(
        "/round-0001/global.safetensors: No space left on device. The model store is full or not writable: fix it, "
        "then resume the run from this round"
    )
    assert not store.global_model(job.job, RUN_ID, 1).exists()


def test_the_operator_leaves_the_rounds_writes_to_core() -> None:
    """The seam's rule: the round's writes (and their order) have one home, core/aggregation/round_output.py."""
    from flare_airflow.operators import aggregate

    tree = ast.parse(pathlib.Path(aggregate.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    writers = {"write_artifact", "atomic_write", "record_central_release", "FLModel"}
    assert not names & writers, f"operators/aggregate.py writes to the store itself: {sorted(names & writers)}"


def test_fedadam_state_is_stored_per_round_pinned_and_a_retry_writes_the_same_bytes(tmp_path) -> None:
    job = make_job(tmp_path, min_clients=3, sites={s: {} for s in SITES}, aggregator={"name": "fedadam"})
    store, ti = setup_round(job, {"site-1": 1.0, "site-2": 2.0, "site-3": 3.0})
    first = operator(job).execute(context(ti))
    state_1 = store.server_state(job.job, RUN_ID, 1)
    state, record = read_artifact(state_1)
    assert first["strategy"] == "fedadam" and first["state_sha256"] == record.sha256
    assert first["state_blake3"] == record.blake3 and record.blake3
    assert set(state) == {"fedadam/m/w", "fedadam/v/w"}
    params, _ = read_artifact(store.global_model(job.job, RUN_ID, 1))
    np.testing.assert_allclose(params["w"], [0.1 * 0.2 / (0.2 + 1e-3)] * 3, rtol=1e-6)  # Adam's first step, d = 2
    assert operator(job).execute(context(ti))["sha256"] == first["sha256"]  # a retry: the same bytes
    assert read_artifact(state_1)[1].sha256 == record.sha256

    # Round 2 reads round 1's state, checked against what round 1's aggregation published.
    ti.xcoms[("round_1.global_model", "return_value")] = first
    for site in SITES:
        rec = write_artifact(
            store.site_update(job.job, RUN_ID, 2, site),
            FLModel(params={"w": params["w"] + np.float32(1)}, meta={"num_samples": 10}),
        )
        ti.xcoms[(f"round_2.{site}", "return_value")] = {"sha256": rec.sha256}
    round_2 = AggregateOperator(
        task_id="global_model",
        job=job,
        round_num=2,
        site_task_ids={s: f"round_2.{s}" for s in SITES},
        global_task_id="round_1.global_model",
    )
    second = round_2.execute(context(ti))
    x2, _ = read_artifact(store.global_model(job.job, RUN_ID, 2))
    assert second["state_sha256"] != first["state_sha256"] and (x2["w"] > params["w"]).all()

    # A record naming the published sha256 but another BLAKE3 (the digest the file is verified by): refused.
    rec_path = state_1.with_name("server_state.json")
    kept = rec_path.read_text()
    rec_path.write_text(kept.replace(str(record.blake3), "0" * 64))
    with pytest.raises(AirflowFailException, match=r"was replaced after round 1 published it \(blake3 000000000000"):
        round_2.execute(context(ti))
    rec_path.write_text(kept)
    write_artifact(state_1, FLModel(params={k: v * 0 for k, v in state.items()}))  # replaced behind our back
    with pytest.raises(AirflowFailException, match=r"the server state .* was replaced after round 1 published it"):
        round_2.execute(context(ti))
    for path in (state_1, state_1.with_name("server_state.json")):
        path.unlink()
    with pytest.raises(AirflowFailException, match=r"the server state of round 1 .* is missing"):
        round_2.execute(context(ti))


class _StatesTI(FakeTI):
    """The Task SDK's ``get_task_states``: every site task succeeded except the ``skipped`` ones."""

    skipped: tuple[str, ...] = ()

    def get_task_states(self, dag_id: str, task_ids: list[str], run_ids: list[str]) -> dict:
        return {self.run_id: {t: "skipped" if t in self.skipped else "success" for t in task_ids}}


def test_a_site_that_sat_the_run_out_is_not_a_skipped_site_to_clear(job) -> None:
    """Issue 39: prepare skipped site-3 (no fresh data); the round counts the others and says why
    site-3 is missing -- while a site skipped for no recorded reason still stops the round."""
    store, plain = setup_round(job, {"site-1": 1.0, "site-2": 3.0})
    ti = _StatesTI(xcoms=plain.xcoms)
    ti.skipped = (SITES["site-3"],)
    with pytest.raises(AirflowFailException, match="site-3 were skipped and never ran"):
        operator(job).execute(context(ti))
    ti.xcoms[("prepare", "return_value")] = {"sat_out": {"site-3": "no data announced since its last run"}}
    op = AggregateOperator(task_id="global_model", job=job, round_num=1, site_task_ids=SITES, prepare_task_id="prepare")
    summary = op.execute(context(ti))
    assert summary["accepted"] == ["site-1", "site-2"]
    assert summary["rejected"]["site-3"] == "sat this run out: no data announced since its last run"
    params, _ = read_artifact(store.global_model(job.job, RUN_ID, 1))
    np.testing.assert_allclose(params["w"], [2.0, 2.0, 2.0])


def test_the_round_aborts_its_sites_unfinished_uploads_once_its_model_is_written(job, monkeypatch) -> None:
    """An upload a site left open (a writer killed for good) is ended by the aggregation that read
    its round -- after the site tasks are done (a retry still resumed it) and the model is written.
    The store side of it runs on the S3 emulator: tests/integration/store/test_store_links.py."""
    from flare_airflow.operators import aggregate

    _, ti = setup_round(job, {"site-1": 1.0, "site-2": 3.0})
    calls: list[tuple[str, int | None, bool]] = []

    def abort(job_, run_id, log, *, store=None, round_num=None, client=None):
        calls.append((run_id, round_num, store.global_model(job.job, run_id, 1).exists()))
        return []

    monkeypatch.setattr(aggregate, "abort_site_uploads", abort)
    operator(job).execute(context(ti))
    assert calls == [(RUN_ID, 1, True)]


def test_the_runs_verdict_aborts_every_unfinished_upload_of_the_run(job, monkeypatch) -> None:
    """The run's end, published or not: the verdict (its teardown) ends what any round left open."""
    from flare_airflow.operators import verdict as verdict_module
    from flare_airflow.operators.verdict import RunVerdictOperator

    calls: list[tuple[str, int | None]] = []

    def abort(job_, run_id, log, *, store=None, round_num=None, client=None):
        calls.append((run_id, round_num))
        return []

    monkeypatch.setattr(verdict_module, "abort_site_uploads", abort)
    verdict = RunVerdictOperator(
        task_id="verdict", job=job, prepare_task_id="prepare", aggregate_task_ids=["round_1.global_model"],
        publish_task_id="publish",
    )  # fmt: skip
    ti = FakeTI()
    with pytest.raises(AirflowFailException, match="nothing published"):
        verdict.execute(context(ti))
    ti.xcoms[("publish", "return_value")] = {"round": 1, "sha256": "ab" * 32}
    assert verdict.execute(context(ti))["published"] is True
    assert calls == [(RUN_ID, None), (RUN_ID, None)]
