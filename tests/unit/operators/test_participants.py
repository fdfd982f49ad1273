"""Who trains in a run, as ``prepare`` hands it on (runs started by the sites' data, with keys and
announcements, are tested in tests/unit/test_data_trigger.py)."""

from __future__ import annotations

import logging
import pathlib
from types import SimpleNamespace

from airflow.sdk import Asset

from flare_airflow.operators.data_ready import site_data_asset
from flare_airflow.operators.participants import data_events, run_participants
from tests.unit.airflow_layer import make_job


def _event(site: str) -> SimpleNamespace:
    return SimpleNamespace(partition_key=site, extra={"version": "v1"}, timestamp="t")


def test_only_the_sites_data_asset_starts_a_data_run() -> None:
    other = {Asset(name="flare_airflow.other.global_model"): [_event("site-1")]}
    assert data_events({"triggering_asset_events": other}) is None
    assert data_events({}) is None
    # Started by the sites' data, even with no event left to read: an empty list, not None.
    assert data_events({"triggering_asset_events": {site_data_asset(): []}}) == []
    assert data_events({"triggering_asset_events": {site_data_asset(): [_event("site-2")]}}) == [
        {"partition_key": "site-2", "extra": {"version": "v1"}, "timestamp": "t"}
    ]


def test_a_form_run_of_a_job_without_on_data_trains_on_the_sites_it_names(tmp_path: pathlib.Path) -> None:
    job = make_job(tmp_path, sites={"site-1": {}, "site-2": {}, "site-3": {}})
    context = {"params": {}, "ti": SimpleNamespace(dag_id="flare_unit"), "run_id": "r"}
    got = run_participants(job, context, ("site-3",), 1, task_id="prepare", log=logging.getLogger())
    assert got == {
        "participants": ["site-3"],
        "sat_out": {s: "not chosen for this run (run parameter sites)" for s in ("site-1", "site-2")},
        "data": {},
    }
