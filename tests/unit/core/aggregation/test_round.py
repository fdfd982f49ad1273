"""core/aggregation/round.py: the server state a round builds on and the central-DP releases it records,
without Airflow (the operator's side is tests/unit/operators/test_aggregate.py and test_aggregate_central_dp.py)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from flare_airflow.core.aggregation.round import previous_server_state, record_central_release
from flare_airflow.core.errors import RoundInputError
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.privacy.central import CENTRAL_RELEASES_FILE
from flare_airflow.core.store import ModelStore

JOB, RUN = "job", "run-1"


def _state(store: ModelStore, round_num: int, value: float) -> tuple[str, str | None]:
    record = write_artifact(store.server_state(JOB, RUN, round_num), FLModel(params={"m": np.full(4, value)}))
    return record.sha256, record.blake3


def test_round_one_starts_from_no_state(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    state, out = previous_server_state(
        store, JOB, RUN, 1, strategy="fedadam", published_sha256=None, published_blake3=None
    )
    assert state == {} and out == store.server_state(JOB, RUN, 1)


def test_the_published_state_is_read_and_verified(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    sha, b3 = _state(store, 1, 0.5)
    state, out = previous_server_state(
        store, JOB, RUN, 2, strategy="fedadam", published_sha256=sha, published_blake3=b3
    )
    assert out == store.server_state(JOB, RUN, 2)
    np.testing.assert_array_equal(state["m"], np.full(4, 0.5))


def test_a_missing_state_names_the_round_to_resume_from(tmp_path: pathlib.Path) -> None:
    with pytest.raises(RoundInputError, match=r"round 3: the server state of round 2 \(fedadam's moments\) is missing"):
        previous_server_state(
            ModelStore(tmp_path), JOB, RUN, 3, strategy="fedadam", published_sha256="a" * 64, published_blake3=None
        )


def test_a_state_replaced_after_it_was_published_is_refused(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    sha, b3 = _state(store, 1, 0.5)
    _state(store, 1, 0.0)  # written over behind the aggregation's back
    with pytest.raises(RoundInputError, match=r"was replaced after round 1 published it \(sha256 .*clear round 1"):
        previous_server_state(store, JOB, RUN, 2, strategy="fedadam", published_sha256=sha, published_blake3=b3)


def test_a_state_whose_bytes_no_longer_match_its_record_is_unusable(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    sha, b3 = _state(store, 1, 0.5)
    path = store.server_state(JOB, RUN, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(RoundInputError, match=r"round 2: the server state of round 1 is unusable"):
        previous_server_state(store, JOB, RUN, 2, strategy="fedadam", published_sha256=sha, published_blake3=b3)


def test_a_retried_release_is_charged_once_and_earlier_rounds_count(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    assert record_central_release(store, JOB, RUN, 1, {"a": "1" * 64, "b": "2" * 64}) == 1
    assert record_central_release(store, JOB, RUN, 1, {"a": "1" * 64, "b": "2" * 64}) == 1  # a retry: same release
    assert record_central_release(store, JOB, RUN, 1, {"a": "1" * 64}) == 2  # another accepted set: another release
    assert record_central_release(store, JOB, RUN, 2, {"a": "3" * 64}) == 3
    recorded = json.loads((store.round_dir(JOB, RUN, 1) / CENTRAL_RELEASES_FILE).read_text())
    assert len(recorded) == 2


def test_an_unwritable_store_releases_nothing(tmp_path: pathlib.Path) -> None:
    store = ModelStore(tmp_path)
    store.run_dir(JOB, RUN).parent.mkdir(parents=True)
    store.run_dir(JOB, RUN).write_text("not a folder")  # the round's folder cannot be made
    with pytest.raises(RoundInputError, match=r"cannot record the central-DP release .* nothing was released"):
        record_central_release(store, JOB, RUN, 1, {"a": "1" * 64})


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{}", "not a list of release names"),
        (b'["not a release"]', "not a list of release names"),
        (b"[", "not JSON"),
        (None, "Is a directory"),
    ],
)
def test_a_damaged_release_record_is_refused_not_taken_as_empty(
    tmp_path: pathlib.Path, content: bytes | None, problem: str
) -> None:
    store = ModelStore(tmp_path)
    record_central_release(store, JOB, RUN, 1, {"a": "1" * 64})
    path = store.round_dir(JOB, RUN, 1) / CENTRAL_RELEASES_FILE
    path.unlink()
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    # Round 2 counts round 1's releases: a record reset by damage would charge them no more.
    with pytest.raises(RoundInputError, match=rf"^round 2: the central-DP release record .* is unusable \({problem}"):
        record_central_release(store, JOB, RUN, 2, {"a": "2" * 64})
    with pytest.raises(RoundInputError, match=r"nothing was released\. Restore the file, then clear this task$"):
        record_central_release(store, JOB, RUN, 1, {"a": "3" * 64})


def test_each_site_counts_with_its_update_or_with_the_reason_it_does_not(tmp_path: pathlib.Path) -> None:
    """Sat out, refused, not accepted by its task, published, missing: the reason each site gives."""
    from flare_airflow.core.aggregation.round import round_inputs
    from flare_airflow.core.failure_record import write_failure
    from flare_airflow.core.spec import JobReturnCode

    store = ModelStore(tmp_path)
    sites = ["a-out", "b-refused", "c-failed", "d-failed-no-xcom", "e-ok", "f-missing"]
    for site in ("c-failed", "d-failed-no-xcom", "e-ok"):
        write_artifact(store.site_update("j", "r", 1, site), FLModel(params={"w": np.ones(2)}))
    write_failure(store.site_update("j", "r", 1, "d-failed-no-xcom"), JobReturnCode.EXECUTION_ERROR, "exit 1")
    got = round_inputs(
        store, "j", "r", 1, sites,
        sat_out={"a-out": "no fresh data"}, refused={"b-refused": "bad signature"},
        accepted={"e-ok": "0" * 64, "f-missing": "1" * 64},
        task_failure=lambda site: "OOM killed" if site == "c-failed" else None,
    )  # fmt: skip
    assert got == [
        ("a-out", None, "sat this run out: no fresh data"),
        ("b-refused", None, "bad signature"),
        # A file the failed task's trainer left does not count: its task did not accept it.
        ("c-failed", None, "OOM killed"),
        ("d-failed-no-xcom", None, "exit 1 [EXECUTION_ERROR]"),
        ("e-ok", store.site_update("j", "r", 1, "e-ok"), None),
        ("f-missing", None, "no update: the site task failed before its trainer ran, or never ran"),
    ]
