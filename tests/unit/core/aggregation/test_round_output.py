"""core/aggregation/round_output.py: a round's writes in their order (state, central release, global
model), the typed error of a store that refuses them, and the summary's fields, without Airflow (the
operator's side, which maps the errors to a failed task, is tests/unit/operators/test_aggregate.py)."""

from __future__ import annotations

import errno
import json
import os
import pathlib

import numpy as np
import pytest

from flare_airflow.core.aggregation import round as round_module
from flare_airflow.core.aggregation.round_output import RoundWritten, round_summary, write_round
from flare_airflow.core.aggregation.tally import RoundOutcome
from flare_airflow.core.errors import RoundInputError, RoundWriteError
from flare_airflow.core.model import read_artifact
from flare_airflow.core.privacy.central import CENTRAL_RELEASES_FILE
from flare_airflow.core.store import ModelStore, record_path

JOB, RUN = "job", "run-1"
ACCEPTED = {"site-1": "a" * 64, "site-2": "b" * 64}


def _outcome(**fields: object) -> RoundOutcome:
    values: dict = {
        "params": {"w": np.full(3, 2.0, np.float32)},
        "accepted": {"site-1": 1.0, "site-2": 1.0},
        "rejected": {"site-3": "no update: the site task failed before its trainer ran, or never ran"},
        "metrics": {"loss": 0.25},
        "site_metrics": {"site-1": {"loss": 0.2}, "site-2": {"loss": 0.3}},
        "num_samples": 20,
    }
    values.update(fields)
    return RoundOutcome(**values)


def _state(store: ModelStore) -> tuple:
    return store.server_state(JOB, RUN, 1), {"fedadam/m/w": np.ones(3, np.float32)}


def _write(store: ModelStore, **kwargs: object) -> RoundWritten:
    return write_round(store, JOB, RUN, 1, _outcome(), strategy="fedadam", **kwargs)  # type: ignore[arg-type]


def test_the_round_writes_its_state_and_its_global_model(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    written = _write(store, state=_state(store))
    assert written.global_model == store.global_model(JOB, RUN, 1) and written.central_releases is None
    params, record = read_artifact(written.global_model)
    np.testing.assert_array_equal(params["w"], np.full(3, 2.0, np.float32))
    assert record == written.record and record.metrics == {"loss": 0.25}
    assert record.meta == {"round": 1, "sites": ["site-1", "site-2"], "num_samples_total": 20}
    state, state_record = read_artifact(store.server_state(JOB, RUN, 1))
    assert state_record == written.state_record and state_record.meta == {"round": 1, "strategy": "fedadam"}
    np.testing.assert_array_equal(state["fedadam/m/w"], np.ones(3, np.float32))


def test_a_stateless_round_writes_no_state(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    written = _write(store)
    assert written.state_record is None and not store.server_state(JOB, RUN, 1).exists()


def test_a_global_model_the_store_refuses_leaves_the_state_written_and_no_global(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    global_out = store.global_model(JOB, RUN, 1)
    global_out.mkdir(parents=True)  # the rename onto it fails, as on a store that refuses the file
    with pytest.raises(RoundWriteError) as info:
        _write(store, state=_state(store), central_dp=True, accepted_sha256=ACCEPTED)
    assert str(info.value) == (
        f"round 1: cannot write the global model {global_out}: Is a directory. The model store is full or not "
        "writable: fix it, then resume the run from this round"
    )
    # The state went first: a retry runs from round 0's state, which nothing overwrote, and writes it again.
    assert read_artifact(store.server_state(JOB, RUN, 1))[1].meta["strategy"] == "fedadam"
    # The release was recorded before the model was written: the retry charges the same release once.
    assert len(json.loads((store.round_dir(JOB, RUN, 1) / CENTRAL_RELEASES_FILE).read_text())) == 1
    assert not record_path(global_out).exists()
    global_out.rmdir()
    assert _write(store, state=_state(store), central_dp=True, accepted_sha256=ACCEPTED).central_releases == 1


def test_an_unwritable_store_refuses_the_state_first_and_writes_nothing(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    round_dir = store.round_dir(JOB, RUN, 1)
    round_dir.parent.mkdir(parents=True)
    round_dir.write_bytes(b"")  # a file where the round's folder goes: every write under it fails
    state_out = store.server_state(JOB, RUN, 1)
    with pytest.raises(RoundWriteError) as info:
        _write(store, state=_state(store), central_dp=True, accepted_sha256=ACCEPTED)
    assert str(info.value) == (
        f"round 1: cannot write the server state {state_out}: File exists. The model store is full or not "
        "writable: fix it, then resume the run from this round"
    )
    with pytest.raises(RoundWriteError, match=r"^round 1: cannot write the global model .*: File exists\. The model"):
        _write(store)


def test_a_release_that_cannot_be_recorded_is_not_released(tmp_path: pathlib.Path, monkeypatch) -> None:
    store = ModelStore(tmp_path)

    def full(path: object, data: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # The store fills up after the state was written (root ignores permissions, so no chmod here).
    monkeypatch.setattr(round_module, "atomic_write", full)
    with pytest.raises(
        RoundInputError,
        match=r"^round 1: cannot record the central-DP release in the model store: No space left on device; nothing",
    ):
        _write(store, state=_state(store), central_dp=True, accepted_sha256=ACCEPTED)
    assert store.server_state(JOB, RUN, 1).exists() and not store.global_model(JOB, RUN, 1).exists()


def test_the_release_names_the_digest_each_accepted_site_task_vouched_for(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    assert _write(store, central_dp=True, accepted_sha256=ACCEPTED).central_releases == 1
    assert _write(store, central_dp=True, accepted_sha256=ACCEPTED).central_releases == 1  # a retry: same release
    other = {**ACCEPTED, "site-2": "c" * 64}  # site-2's task ran again and vouched for another update
    assert _write(store, central_dp=True, accepted_sha256=other).central_releases == 2


def test_the_summary_fields_in_their_order(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    outcome = _outcome(selected=["site-1"], clipped={"site-2": 0.5})
    written = write_round(store, JOB, RUN, 1, outcome, strategy="fedadam", state=_state(store))
    state = written.state_record
    assert state is not None and state.blake3
    summary = round_summary(
        written,
        outcome,
        round_num=1,
        strategy="fedadam",
        strategy_params={"eta": 0.5},
        site_sha256={"site-2": "b" * 64, "site-1": "a" * 64},
        signed={"sig": "s"},
        links={"links": {"site-1": "sealed"}},
        evaluation={"accuracy": 0.9},
        privacy=None,
    )
    assert summary == {
        "round": 1,
        "global_uri": str(store.global_model(JOB, RUN, 1)),
        "sha256": written.record.sha256,
        "signed": {"sig": "s"},
        "links": {"site-1": "sealed"},
        "accepted": ["site-1", "site-2"],
        "site_sha256": {"site-1": "a" * 64, "site-2": "b" * 64},
        "rejected": outcome.rejected,
        "strategy": "fedadam",
        "strategy_params": {"eta": 0.5},
        "state_sha256": state.sha256,
        "state_blake3": state.blake3,
        "selected": ["site-1"],
        "clipped": {"site-2": 0.5},
        "num_samples": 20,
        "metrics": {"loss": 0.25},
        "site_metrics": {"site-1": {"loss": 0.2}, "site-2": {"loss": 0.3}},
        "evaluation": {"accuracy": 0.9},
        "privacy": None,
    }
    # XCom keeps the order: the same keys in the same order as every summary before this module.
    assert list(summary) == [
        "round", "global_uri", "sha256", "signed", "links", "accepted", "site_sha256", "rejected", "strategy",
        "strategy_params", "state_sha256", "state_blake3", "selected", "clipped", "num_samples", "metrics",
        "site_metrics", "evaluation", "privacy",
    ]  # fmt: skip
    assert list(summary["site_sha256"]) == ["site-1", "site-2"]


def test_a_summary_without_state_links_selection_clips_or_task_ids_leaves_those_keys_out(
    tmp_path: pathlib.Path,
) -> None:
    store = ModelStore(tmp_path)
    outcome = _outcome()
    written = write_round(store, JOB, RUN, 1, outcome, strategy="fedavg")
    summary = round_summary(
        written,
        outcome,
        round_num=1,
        strategy="fedavg",
        strategy_params={},
        site_sha256=None,
        signed={"sig": "s"},
        evaluation={},
        privacy={"epsilon": 1.0},
    )
    assert list(summary) == [
        "round", "global_uri", "sha256", "signed", "accepted", "site_sha256", "rejected", "strategy",
        "strategy_params", "num_samples", "metrics", "site_metrics", "evaluation", "privacy",
    ]  # fmt: skip
    assert summary["site_sha256"] is None and summary["privacy"] == {"epsilon": 1.0}
