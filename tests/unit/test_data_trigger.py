"""Runs driven by the sites' data (issue 39), without a scheduler: the job's on_data block, the
schedule it becomes, which sites a run trains on, and who may announce for a site."""

from __future__ import annotations

import datetime as dt
import json
import logging
import pathlib
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.builder import build_dag
from flare_airflow.core.data_ready import (
    SITE_DATA_ASSET,
    SiteData,
    announcement_id,
    data_payload,
    decide_run,
    fresh_sites,
)
from flare_airflow.core.trust import TrustError, generate_keys, sign_record
from flare_airflow.core.trust.keys import party_dir
from flare_airflow.core.trust.settings import TrustSettings
from flare_airflow.operators import data_ready as data_ready_ops
from flare_airflow.operators import participants
from flare_airflow.operators.data_ready import site_data_asset
from flare_airflow.operators.data_watch import DataHistory
from tests.unit.airflow_layer import make_job

SITES = ["site-1", "site-2", "site-3", "site-4"]
NOW = dt.datetime(2026, 12, 6, 8, 0, tzinfo=dt.UTC)


@pytest.fixture
def keys(tmp_path: pathlib.Path) -> TrustSettings:
    """Strict trust: every site's key made, all four enrolled in one registry."""
    key_dir = tmp_path / "keys"
    registry = {"keys": []}
    for site in SITES:
        registry["keys"] += generate_keys(site, party_dir(key_dir, site)).jwks["keys"]
    path = tmp_path / "registry.json"
    path.write_text(json.dumps(registry))
    return TrustSettings(key_dir=str(key_dir), registry_path=str(path))


def announce(settings: TrustSettings, site: str, version: str, *, signer: str | None = None, ago_s: int = 60) -> dict:
    """An asset event as the run sees it: partition key = the site, extra = the signed record."""
    payload = data_payload(site=site, version=version, samples=100, announced_at=NOW - dt.timedelta(seconds=ago_s))
    kid, key = settings.signing_key(signer or site)
    return {"partition_key": site, "extra": {**payload, "signed": sign_record(payload, kid, key)}}


def verifier(settings: TrustSettings):
    registry = settings.registry()

    def verify(signed: Any, site: str) -> dict:
        payload, _ = settings.verify(
            signed, party=site, expect={"type": "data", "site": site}, what="x", registry=registry
        )
        assert payload is not None
        return payload

    return verify


def test_the_fresh_signed_sites_train_and_the_others_sit_out_saying_why(keys) -> None:
    events = [
        announce(keys, "site-1", "v1"),
        announce(keys, "site-2", "v7"),
        announce(keys, "site-2", "v7"),  # the same announcement twice counts once
        announce(keys, "site-3", "2026-12-05", ago_s=3 * 86400),  # older than the 1 d window
    ]
    data = fresh_sites(events, SITES, window_seconds=86400, now=NOW, verify=verifier(keys))
    assert {s: d.version for s, d in data.items() if d.reason is None} == {"site-1": "v1", "site-2": "v7"}
    assert "older than the window" in str(data["site-3"].reason)
    assert data["site-4"].reason == "no data announced since its last run"
    assert data["site-1"].to_dict()["samples"] == 100


def test_a_site_cannot_announce_for_another(keys) -> None:
    """site-1 signs an announcement under site-2's partition: refused, site-2 is not fresh."""
    events = [announce(keys, "site-2", "forged", signer="site-1")]
    data = fresh_sites(events, SITES, window_seconds=86400, now=NOW, verify=verifier(keys))
    assert data["site-2"].version is None
    assert "its announcement was refused" in str(data["site-2"].reason)
    assert "not by 'site-2'" in str(data["site-2"].reason)


def test_a_site_announcement_changed_after_signing_is_refused(keys) -> None:
    event = announce(keys, "site-1", "v1")
    event["extra"]["signed"]["payload"]["version"] = "v2"
    data = fresh_sites([event], SITES, window_seconds=86400, now=NOW, verify=verifier(keys))
    assert "changed or forged" in str(data["site-1"].reason)


def test_the_newest_announcement_of_a_site_counts(keys) -> None:
    events = [announce(keys, "site-1", "v1", ago_s=600), announce(keys, "site-1", "v2", ago_s=60)]
    data = fresh_sites(events, SITES, window_seconds=86400, now=NOW, verify=verifier(keys))
    assert data["site-1"].version == "v2"


def data_job(tmp_path: pathlib.Path, min_sites: int = 3, wait: str | None = None, **overrides: Any) -> Any:
    on_data = {"min_sites": min_sites, "window": "1d", **({"wait": wait} if wait else {})}
    return make_job(tmp_path, min_clients=2, sites={s: {} for s in SITES}, trigger={"on_data": on_data}, **overrides)


def test_on_data_becomes_airflows_partitioned_schedule_with_the_quorum(tmp_path) -> None:
    from airflow.sdk import MinimumCount, PartitionedAssetTimetable, SegmentWindow
    from airflow.serialization.serialized_objects import DagSerialization

    dag = build_dag(data_job(tmp_path))
    timetable = dag.timetable
    assert isinstance(timetable, PartitionedAssetTimetable)
    mapper = timetable.default_partition_mapper
    assert mapper.wait_policy == MinimumCount(3)
    assert mapper.window == SegmentWindow(SITES)
    assert dag.params["sites"] == []
    assert "runs when 3 of its 4 sites announced fresh data (window 1d)" in str(dag.description)
    # The scheduler reads the serialized DAG: the rollup must survive it.
    text = json.dumps(DagSerialization.to_dict(dag))
    assert SITE_DATA_ASSET in text and "MinimumCount" in text


def _context(events: list[dict], dag_params: dict | None = None) -> dict:
    refs = [SimpleNamespace(partition_key=e["partition_key"], extra=e["extra"], timestamp=NOW) for e in events]
    return {"triggering_asset_events": {site_data_asset(): refs}, **_form(dag_params)}


def _participants(job: Any, context: dict, chosen: tuple[str, ...] | None, min_clients: int) -> dict:
    return participants.run_participants(job, context, chosen, min_clients, task_id="prepare", log=logging.getLogger())


def _form(dag_params: dict | None = None) -> dict:
    """A run's context as prepare reads it, without the data's events."""
    return {"params": dag_params or {}, "ti": SimpleNamespace(dag_id="flare_j"), "run_id": "this"}


@pytest.fixture(autouse=True)
def history(monkeypatch) -> DataHistory:
    """What the REST API says the job's earlier runs did: nothing, unless a test says otherwise."""
    found = DataHistory()
    monkeypatch.setattr(participants, "read_history", lambda *a, **kw: found)
    return found


def test_prepare_trains_on_the_fresh_sites_and_records_their_data(tmp_path, keys, monkeypatch) -> None:
    monkeypatch.setattr(data_ready_ops, "trust_settings", lambda: keys)
    job = data_job(tmp_path)
    events = [announce(keys, s, f"v-{s}", ago_s=30) for s in SITES[:3]]
    monkeypatch.setattr(participants, "_now", lambda: NOW)
    out = _participants(job, _context(events), None, 2)
    assert out["participants"] == SITES[:3]
    assert out["sat_out"] == {"site-4": "no data announced since its last run"}
    assert out["data"]["site-2"]["version"] == "v-site-2"


def test_prepare_refuses_a_run_with_fewer_fresh_sites_than_the_quorum(tmp_path, keys, monkeypatch) -> None:
    monkeypatch.setattr(data_ready_ops, "trust_settings", lambda: keys)
    monkeypatch.setattr(participants, "_now", lambda: NOW)
    job = data_job(tmp_path)
    events = [announce(keys, "site-1", "v1"), announce(keys, "site-2", "x", signer="site-1")]
    with pytest.raises(AirflowFailException, match=r"only 1 site\(s\) have fresh, signed data \(site-1\)"):
        _participants(job, _context(events), None, 2)


def test_a_form_run_trains_on_the_sites_it_names(tmp_path) -> None:
    job = data_job(tmp_path)
    out = _participants(job, _form(), ("site-1", "site-3"), 2)
    assert out["participants"] == ["site-1", "site-3"]
    assert set(out["sat_out"]) == {"site-2", "site-4"}


def test_a_job_without_on_data_records_nothing_new(tmp_path) -> None:
    job = make_job(tmp_path)
    assert _participants(job, _form(), None, 1) == {}


def test_the_cli_cannot_sign_for_a_site_whose_key_is_elsewhere(tmp_path, monkeypatch) -> None:
    from flare_airflow.core.data_ready import AnnouncementError
    from flare_airflow.operators import data_ready

    worker = TrustSettings(key_dir=str(tmp_path / "site-1-worker"))
    generate_keys("site-1", party_dir(tmp_path / "site-1-worker", "site-1"))
    monkeypatch.setattr(data_ready, "trust_settings", lambda: worker)
    assert data_ready.signed_announcement("site-1", "v1", 5, create_key=False)["signed"]["payload"]["site"] == "site-1"
    with pytest.raises((AnnouncementError, TrustError), match="no signing key"):
        data_ready.signed_announcement("site-2", "v1", 5, create_key=False)


def test_the_operator_announces_for_its_site_on_the_sites_queue(tmp_path, monkeypatch) -> None:
    from airflow.sdk.execution_time.context import OutletEventAccessors

    from flare_airflow.operators import data_ready

    worker = TrustSettings(key_dir=str(tmp_path / "keys"))
    monkeypatch.setattr(data_ready, "trust_settings", lambda: worker)
    op = data_ready.DataReadyOperator(task_id="data_ready", site="site-1", version="2026-12-06", samples="250")
    assert op.queue == "site-1"
    events = OutletEventAccessors()
    summary = op.execute({"outlet_events": events})  # type: ignore[arg-type]
    event = events[site_data_asset()]
    assert event.partition_keys == {"site-1"}
    assert summary == {
        "site": "site-1",
        "version": "2026-12-06",
        "samples": 250,
        "announced_at": summary["announced_at"],
    }
    registry = worker.registry()
    payload, _ = worker.verify(
        event.extra["signed"], party="site-1", expect={"type": "data"}, what="x", registry=registry
    )
    assert payload is not None and payload["version"] == "2026-12-06"


def test_an_announcement_an_earlier_run_used_never_counts_again(keys) -> None:
    """A run started by the wait leaves its announcements in Airflow's queue: the next run must
    not train on them again, while a newer announcement of the same site counts."""
    events = [announce(keys, "site-1", "v1"), announce(keys, "site-2", "v1"), announce(keys, "site-3", "v2", ago_s=30)]
    v1 = {e["partition_key"]: e["extra"]["announced_at"] for e in events[:2]}
    used = {
        announcement_id("site-1", "v1", v1["site-1"]): "wait__1",
        announcement_id("site-2", "v1", v1["site-2"]): "wait__1",
        announcement_id("site-3", "v1", v1["site-1"]): "wait__1",  # another version of site-3: not this one
    }
    data = fresh_sites(events, SITES, window_seconds=86400, now=NOW, verify=verifier(keys), used=used)
    assert [s for s, d in data.items() if d.reason is None] == ["site-3"]
    assert data["site-1"].reason == f"its data v1 announced at {v1['site-1']} was used by run wait__1"
    newer = [*events, announce(keys, "site-1", "v2", ago_s=10)]
    data = fresh_sites(newer, SITES, window_seconds=86400, now=NOW, verify=verifier(keys), used=used)
    assert {s: d.version for s, d in data.items() if d.reason is None} == {"site-1": "v2", "site-3": "v2"}


def fresh(**ago_s: int) -> dict[str, SiteData]:
    """fresh_sites' answer: the named sites fresh (announced ``ago_s`` seconds before NOW)."""
    out = {s: SiteData(s, reason="no data announced since its last run") for s in SITES}
    for key, ago in ago_s.items():
        site = key.replace("_", "-")
        at = (NOW - dt.timedelta(seconds=ago)).isoformat(timespec="seconds")
        out[site] = SiteData(site, "v1", 10, at)
    return out


DECIDE = {"min_sites": 3, "quorum": 2, "wait_seconds": 6 * 3600, "now": NOW}


def test_the_wait_expiring_with_a_quorum_runs_over_exactly_the_fresh_sites() -> None:
    decision = decide_run(fresh(site_2=7 * 3600, site_4=60), **DECIDE)
    assert decision.sites == ("site-2", "site-4")
    assert decision.why == "the wait expired at 2026-12-06T07:00:00+00:00 with 2 fresh site(s) (site-2, site-4)"


def test_the_wait_expiring_without_a_quorum_runs_nothing_and_says_why() -> None:
    decision = decide_run(fresh(site_2=7 * 3600), **DECIDE)
    assert decision.sites == ()
    assert decision.why == (
        "the wait expired at 2026-12-06T07:00:00+00:00 with only 1 fresh site(s) (site-2), below the quorum "
        "min_clients 2: no run until more sites announce"
    )


def test_before_the_wait_expires_nothing_runs_and_the_expiry_is_named() -> None:
    decision = decide_run(fresh(site_2=3600, site_4=60), **DECIDE)
    assert decision.sites == ()
    assert decision.why.endswith("the wait expires at 2026-12-06T13:00:00+00:00")


def test_at_min_sites_the_data_schedule_runs_never_the_watch() -> None:
    """Airflow's own timetable starts that run: a second one over the same data would count it twice."""
    decision = decide_run(fresh(site_1=7 * 3600, site_2=60, site_3=60), **DECIDE)
    assert decision.sites == () and "the data schedule starts the run" in decision.why


def test_the_fallback_runs_over_the_fresh_sites_when_no_run_happened_since() -> None:
    week_ago = NOW - dt.timedelta(days=7)
    kw = {**DECIDE, "wait_seconds": None, "fallback_since": week_ago}
    assert decide_run(fresh(site_1=60, site_3=60), **kw, last_run_at=None).sites == ("site-1", "site-3")
    ran = decide_run(fresh(site_1=60, site_3=60), **kw, last_run_at=NOW - dt.timedelta(days=2))
    assert ran.sites == () and "waiting for more sites" in ran.why
    alone = decide_run(fresh(site_1=60), **kw, last_run_at=NOW - dt.timedelta(days=8))
    assert alone.sites == ()
    assert alone.why == (
        "the schedule's fallback found no run since 2026-11-29T08:00:00+00:00 but only 1 fresh site(s) (site-1), "
        "below the quorum min_clients 2"
    )


def test_a_data_run_handed_announcements_a_watch_run_used_does_not_train_on_them(
    tmp_path, keys, monkeypatch, history
) -> None:
    """Airflow's queue still holds site-1 and site-2 after the wait's run used them; site-3 then
    completes Airflow's count of 3: prepare refuses rather than train on site-1/site-2 twice."""
    monkeypatch.setattr(data_ready_ops, "trust_settings", lambda: keys)
    monkeypatch.setattr(participants, "_now", lambda: NOW)
    events = [announce(keys, s, "v1") for s in SITES[:3]]
    for e in events[:2]:
        history.used[announcement_id(e["partition_key"], "v1", e["extra"]["announced_at"])] = "manual__wait"
    job = data_job(tmp_path)
    with pytest.raises(AirflowFailException, match=r"only 1 site\(s\) have fresh, signed data \(site-3\)") as err:
        _participants(job, _context(events), None, 2)
    assert "site-1: its data v1 announced at" in str(err.value) and "was used by run manual__wait" in str(err.value)


def test_a_run_the_watch_started_records_the_unused_data_of_its_sites(tmp_path, keys, monkeypatch, history) -> None:
    monkeypatch.setattr(data_ready_ops, "trust_settings", lambda: keys)
    monkeypatch.setattr(participants, "_now", lambda: NOW)
    history.events += [announce(keys, "site-2", "v3"), announce(keys, "site-4", "v9")]
    job = data_job(tmp_path, wait="6h")
    out = _participants(job, _form(), ("site-2", "site-4"), 2)
    assert out["participants"] == ["site-2", "site-4"]
    assert {s: d["version"] for s, d in out["data"].items()} == {"site-2": "v3", "site-4": "v9"}
    assert "reason" not in out["data"]["site-2"]


class FakeAPI:
    """Airflow's REST API as the watch reads it: runs, their prepare XComs, the announcements."""

    def __init__(self, runs: list[dict], prepared: dict[str, dict], events: list[dict]) -> None:
        self.runs, self.prepared, self.events, self.posted = runs, prepared, events, []

    def __call__(self, method: str, path: str, **kw: Any) -> SimpleNamespace:
        def answer(body: Any, status: int = 200) -> SimpleNamespace:
            return SimpleNamespace(status_code=status, json=lambda: body, text=json.dumps(body))

        if method == "POST":
            self.posted.append((path, kw["json"]))
            return answer({"dag_run_id": "manual__watch"})
        if path.endswith("/dagRuns"):
            return answer({"dag_runs": self.runs})
        if "/xcomEntries/" in path:
            run_id = path.split("/dagRuns/")[1].split("/")[0]
            return answer(
                {"value": json.dumps(self.prepared[run_id])} if run_id in self.prepared else {},
                200 if run_id in self.prepared else 404,
            )
        if path == "/api/v2/assets":
            return answer({"assets": [{"id": 7, "name": SITE_DATA_ASSET}]})
        return answer(
            {
                "asset_events": [
                    {"partition_key": e["partition_key"], "extra": e["extra"], "timestamp": "t"} for e in self.events
                ]
            }
        )


def _watch(tmp_path, keys, monkeypatch, api: FakeAPI, **on_data: Any) -> dict:
    import contextlib

    from flare_airflow.hooks import pools
    from flare_airflow.operators import data_watch

    monkeypatch.setattr(data_ready_ops, "trust_settings", lambda: keys)
    monkeypatch.setattr(pools, "api_client", lambda *a, **kw: contextlib.nullcontext(api))
    monkeypatch.setattr(data_watch, "_now", lambda: NOW)
    job = data_job(tmp_path, **on_data)
    return data_watch.DataWatchOperator(task_id="decide", job=job, watched_dag_id="flare_j").execute({})  # type: ignore[arg-type]


def test_the_watch_starts_a_run_over_the_unused_fresh_sites_when_the_wait_expired(tmp_path, keys, monkeypatch) -> None:
    used = announce(keys, "site-1", "v1", ago_s=8 * 3600)
    api = FakeAPI(
        runs=[{"dag_run_id": "r1", "state": "success", "run_after": (NOW - dt.timedelta(hours=7)).isoformat()}],
        prepared={"r1": {"data": {"site-1": used["extra"] | {"samples": 100}}}},
        events=[used, announce(keys, "site-2", "v1", ago_s=7 * 3600), announce(keys, "site-3", "v1", ago_s=60)],
    )
    out = _watch(tmp_path, keys, monkeypatch, api, wait="6h")
    assert out["sites"] == ["site-2", "site-3"] and out["run_id"] == "manual__watch"
    assert api.posted == [
        (
            "/api/v2/dags/flare_j/dagRuns",
            {"logical_date": None, "conf": {"sites": ["site-2", "site-3"]}, "note": out["why"]},
        )
    ]


class RefusingAssetsAPI(FakeAPI):
    """The announcements cannot be read (e.g. a user without asset access): 403."""

    def __call__(self, method: str, path: str, **kw: Any) -> SimpleNamespace:
        if path.startswith("/api/v2/assets"):
            body = {"detail": "Forbidden"}
            return SimpleNamespace(status_code=403, json=lambda: body, text=json.dumps(body))
        return super().__call__(method, path, **kw)


def test_the_watch_fails_saying_why_when_it_cannot_read_the_announcements(tmp_path, keys, monkeypatch) -> None:
    """An unread history must never look like no data: the watch fails, it does not decide."""
    from airflow.sdk.exceptions import AirflowFailException

    api = RefusingAssetsAPI([], {}, [announce(keys, "site-1", "v1"), announce(keys, "site-2", "v1")])
    with pytest.raises(AirflowFailException, match=r"cannot read the site-data asset \(403"):
        _watch(tmp_path, keys, monkeypatch, api, wait="6h")
    assert api.posted == []


def test_the_watch_starts_nothing_without_a_quorum_or_while_a_run_is_going(tmp_path, keys, monkeypatch) -> None:
    lone = [announce(keys, "site-2", "v1", ago_s=7 * 3600)]
    out = _watch(tmp_path, keys, monkeypatch, FakeAPI([], {}, lone), wait="6h")
    assert out == {"sites": [], "why": out["why"]} and "below the quorum min_clients 2" in out["why"]
    two = [*lone, announce(keys, "site-3", "v1")]
    busy = FakeAPI([{"dag_run_id": "r2", "state": "running", "run_after": NOW.isoformat()}], {}, two)
    out = _watch(tmp_path, keys, monkeypatch, busy, wait="6h")
    assert busy.posted == [] and out["why"] == "run r2 of flare_j has not finished: the watch waits for it"


def test_the_weekly_fallback_runs_when_no_run_happened_in_the_last_week(tmp_path, keys, monkeypatch) -> None:
    two = [announce(keys, "site-2", "v1"), announce(keys, "site-3", "v1")]
    old = [{"dag_run_id": "r0", "state": "success", "run_after": (NOW - dt.timedelta(days=9)).isoformat()}]
    assert _watch(tmp_path, keys, monkeypatch, FakeAPI(old, {}, two), schedule="@weekly")["sites"] == [
        "site-2",
        "site-3",
    ]
    recent = [{"dag_run_id": "r0", "state": "success", "run_after": (NOW - dt.timedelta(days=3)).isoformat()}]
    assert _watch(tmp_path, keys, monkeypatch, FakeAPI(recent, {}, two), schedule="@weekly")["sites"] == []


def test_wait_and_a_cron_schedule_add_the_watch_dag(tmp_path) -> None:
    from flare_airflow.builder import data_watch_dag
    from flare_airflow.operators.data_watch import fallback_since

    watch = data_watch_dag(data_job(tmp_path, wait="6h"), "flare_j")
    assert watch.dag_id == "flare_j_data_watch" and list(watch.task_dict) == ["decide"]
    assert watch.schedule == dt.timedelta(minutes=15)  # a twelfth of 6 h is 30 min: capped at 15
    sunday = fallback_since("@weekly", NOW)  # NOW is Sunday 08:00: the last week began a week before today 00:00
    assert sunday == dt.datetime(2026, 11, 29, tzinfo=dt.UTC)


def test_a_dag_built_with_a_schedule_of_its_own_gets_no_watch(tmp_path, monkeypatch) -> None:
    from flare_airflow import builder

    made: list[str] = []
    monkeypatch.setattr(builder, "data_watch_dag", lambda job, dag_id: made.append(dag_id))
    job = data_job(tmp_path, wait="6h")
    build_dag(job, dag_id="flare_by_hand", schedule=None)
    assert made == []
    build_dag(job, dag_id="flare_data")
    assert made == ["flare_data"]
