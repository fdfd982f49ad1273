"""Attacks on the records that cross a boundary (issue 36 item 5), through the real operators.

Strict mode (a registry configured): each forged, moved, replayed or tampered record is refused
with its reason; the round goes on with the others where ``min_clients`` still holds, and a site
whose input global model's record is refused never starts its trainer.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.failure_record import read_failure
from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.store import ModelStore
from flare_airflow.core.trust import CENTRAL, generate_keys, global_payload, sign_record, update_payload
from flare_airflow.core.trust.keys import load_signing_key, party_dir
from flare_airflow.operators.aggregate import AggregateOperator
from flare_airflow.operators.site_steps import SiteJobFailed, make_site_run
from tests.unit.airflow_layer import RUN_ID, FakeTI, context, make_job

SITES = ("site-1", "site-2", "site-3")


def task(site: str, r: int) -> str:
    return f"round_{r}.{site}"


@pytest.fixture
def keys(tmp_path, monkeypatch) -> pathlib.Path:
    """Every party's keys under one dir and a strict registry listing them (``FLARE_SITE_KEYS``)."""
    key_dir = tmp_path / "keys"
    jwks = [generate_keys(p, party_dir(key_dir, p)).jwks for p in (*SITES, CENTRAL)]
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"keys": [k for j in jwks for k in j["keys"]]}))
    monkeypatch.setenv("FLARE_KEY_DIR", str(key_dir))
    monkeypatch.setenv("FLARE_SITE_KEYS", str(registry))
    return key_dir


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path, min_clients=2, sites={site: {} for site in SITES})


def signed_update(key_dir: pathlib.Path, signer: str, record, r: int, site: str) -> dict:
    p = update_payload(
        job="unit", run_id=RUN_ID, round_num=r, site=site, try_number=1, size=record.size, sha256=record.sha256,
        blake3=None, num_samples=10, params_type="FULL", privacy=None, trainer="t" * 64,
    )  # fmt: skip
    return sign_record(p, *load_signing_key(party_dir(key_dir, signer), signer))


def setup_round(job, key_dir: pathlib.Path, r: int = 1) -> tuple[ModelStore, FakeTI, dict]:
    """Round r-1's global model and each site's genuine, signed round-r update and XCom summary."""
    store = ModelStore.from_uri(job.store)
    write_artifact(store.global_model(job.job, RUN_ID, r - 1), FLModel(params={"w": np.zeros(3, np.float32)}))
    ti, records = FakeTI(), {}
    for n, site in enumerate(SITES, 1):
        record = write_artifact(
            store.site_update(job.job, RUN_ID, r, site),
            FLModel(params={"w": np.full(3, float(n), np.float32)}, metrics={"loss": n / 10}, meta={"num_samples": 10}),
        )
        records[site] = record
        ti.xcoms[(task(site, r), "return_value")] = {
            "sha256": record.sha256, "num_samples": 10, "signed": signed_update(key_dir, site, record, r, site),
        }  # fmt: skip
    return store, ti, records


def aggregate(job, ti: FakeTI, r: int = 1) -> dict:
    op = AggregateOperator(
        task_id=f"round_{r}.global_model", job=job, round_num=r, site_task_ids={s: task(s, r) for s in SITES}
    )
    return op.execute(context(ti))


def test_genuine_signed_records_count_and_the_global_record_is_signed_by_central(job, keys) -> None:
    store, ti, _ = setup_round(job, keys)
    # A URI in XCom is never where an update is read from: its place comes from the site's name.
    ti.xcoms[(task("site-1", 1), "return_value")]["uri"] = str(store.site_update(job.job, RUN_ID, 1, "site-3"))
    summary = aggregate(job, ti)
    assert summary["accepted"] == list(SITES) and summary["rejected"] == {}
    params, _ = read_artifact(store.global_model(job.job, RUN_ID, 1))
    np.testing.assert_array_equal(params["w"], np.full(3, 2.0, np.float32))  # the mean of 1, 2, 3
    assert summary["signed"]["payload"] == {**summary["signed"]["payload"], "round": 1, "sha256": summary["sha256"]}
    assert summary["signed"]["kid"].startswith("central.")


def test_xcom_digest_overwritten_to_match_a_swapped_object_is_refused(job, keys) -> None:
    store, ti, _ = setup_round(job, keys)
    # The attacker swaps site-1's object for its own and overwrites site-1's XCom digest to match.
    evil = write_artifact(
        store.site_update(job.job, RUN_ID, 1, "site-1"),
        FLModel(params={"w": np.full(3, -10.0, np.float32)}, meta={"num_samples": 10}),
    )
    ti.xcoms[(task("site-1", 1), "return_value")]["sha256"] = evil.sha256
    summary = aggregate(job, ti)
    assert summary["accepted"] == ["site-2", "site-3"]
    assert "signed record says sha256" in summary["rejected"]["site-1"]


def test_site_2_writing_into_site_1s_slot_with_its_own_key_is_refused(job, keys) -> None:
    store, ti, _ = setup_round(job, keys)
    evil = write_artifact(
        store.site_update(job.job, RUN_ID, 1, "site-1"),
        FLModel(params={"w": np.full(3, -10.0, np.float32)}, meta={"num_samples": 10}),
    )
    ti.xcoms[(task("site-1", 1), "return_value")] = {
        "sha256": evil.sha256, "num_samples": 10, "signed": signed_update(keys, "site-2", evil, 1, "site-1"),
    }  # fmt: skip
    summary = aggregate(job, ti)
    assert summary["accepted"] == ["site-2", "site-3"]
    assert "signed with 'site-2'" in summary["rejected"]["site-1"]


def test_last_rounds_record_replayed_this_round_is_refused(job, keys) -> None:
    store, ti1, _ = setup_round(job, keys, r=1)
    old = ti1.xcoms[(task("site-1", 1), "return_value")]
    _, ti, _ = setup_round(job, keys, r=2)
    # site-1's round-1 update and its genuine round-1 record, replayed as its round-2 update.
    params, _ = read_artifact(store.site_update(job.job, RUN_ID, 1, "site-1"))
    write_artifact(store.site_update(job.job, RUN_ID, 2, "site-1"), FLModel(params=params, meta={"num_samples": 10}))
    ti.xcoms[(task("site-1", 2), "return_value")] = old
    summary = aggregate(job, ti, r=2)
    assert summary["accepted"] == ["site-2", "site-3"]
    assert "says round 1, expected 2" in summary["rejected"]["site-1"]


def test_unknown_kid_revoked_key_and_unsigned_are_refused_and_quorum_decides(job, keys, tmp_path) -> None:
    _, ti, _ = setup_round(job, keys)
    # site-1 signs with a key nobody enrolled; site-2's key is revoked (removed from the registry).
    rogue = generate_keys("site-1", tmp_path / "rogue")
    p = ti.xcoms[(task("site-1", 1), "return_value")]["signed"]["payload"]
    ti.xcoms[(task("site-1", 1), "return_value")]["signed"] = sign_record(
        p, *load_signing_key(tmp_path / "rogue", "site-1")
    )
    registry = pathlib.Path(str(tmp_path / "registry.json"))
    data = json.loads(registry.read_text())
    data["keys"] = [k for k in data["keys"] if k["flare_party"] != "site-2"]
    registry.write_text(json.dumps(data))
    with pytest.raises(AirflowFailException, match="round 1 failed") as failed:
        aggregate(job, ti)  # one site left: below min_clients 2
    text = str(failed.value)
    assert rogue.signing_kid in text and "never enrolled, or revoked" in text
    assert "site-2" in text
    (tmp_path / "j3").mkdir()
    job3 = make_job(tmp_path / "j3", min_clients=1, sites={site: {} for site in SITES})
    _, ti3, _ = setup_round(job3, keys)
    ti3.xcoms[(task("site-3", 1), "return_value")].pop("signed")
    summary = aggregate(job3, ti3)
    assert summary["accepted"] == ["site-1"]
    assert "not signed" in summary["rejected"]["site-3"] and "revoked" in summary["rejected"]["site-2"]


def _global_summary(keys: pathlib.Path, store: ModelStore, r: int, signer: str = CENTRAL) -> dict:
    record = write_artifact(store.global_model("unit", RUN_ID, r), FLModel(params={"w": np.zeros(3, np.float32)}))
    p = global_payload(job="unit", run_id=RUN_ID, round_num=r, size=record.size, sha256=record.sha256, blake3=None)
    return {"sha256": record.sha256, "signed": sign_record(p, *load_signing_key(party_dir(keys, signer), signer))}


def test_a_site_verifies_the_global_record_before_its_trainer_starts(job, keys) -> None:
    store = ModelStore.from_uri(job.store)
    ti = FakeTI()
    ti.xcoms[("round_1.global_model", "return_value")] = _global_summary(keys, store, 1)
    run = make_site_run(job, "site-1", 2, context(ti), argv=["x"], global_task_id="round_1.global_model")
    assert run.global_sha256 == ti.xcoms[("round_1.global_model", "return_value")]["sha256"]
    assert run.trust == {"key_dir": str(keys), "registry_path": str(keys.parent / "registry.json")}

    cases = {
        # The global model replaced and its XCom digest overwritten to match.
        "replaced": lambda s: {**s, "sha256": "0" * 64},
        # Last round's genuine global record replayed for this round.
        "replayed": lambda s: _global_summary(keys, store, 0),
        # A site signs a global record.
        "site-signed": lambda s: _global_summary(keys, store, 1, signer="site-2"),
        "unsigned": lambda s: {"sha256": s["sha256"]},
    }
    reasons = {
        "replaced": "signed record says sha256",
        "replayed": "says round 0, expected 1",
        "site-signed": "signed with 'site-2'",
        "unsigned": "not signed",
    }
    genuine = _global_summary(keys, store, 1)
    for name, attack in cases.items():
        ti.xcoms[("round_1.global_model", "return_value")] = attack(genuine)
        with pytest.raises(SiteJobFailed, match=reasons[name]):
            make_site_run(job, "site-1", 2, context(ti), argv=["x"], global_task_id="round_1.global_model")
        failure = read_failure(store.site_update(job.job, RUN_ID, 2, "site-1"))
        assert failure is not None and "the trainer was not started" in failure, name
