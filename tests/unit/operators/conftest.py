"""Fixtures of the operators' unit tests: the store and the round links the lifecycle's fake
backend (fake_site_task.py) works against."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
from upath import UPath

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.store import ModelStore
from flare_airflow.operators import lifecycle, links, shared_links, site_steps
from tests.unit.airflow_layer import RUN_ID
from tests.unit.operators.fake_site_task import FakeLinks, stage_in_through_fake_links, stage_out_through_fake_links


@pytest.fixture
def object_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModelStore:
    """The job's store is an in-memory object store (no connection needed for it here)."""
    name = re.sub(r"\W", "-", request.node.name)  # brackets in a URI's host read as IPv6
    store = ModelStore(UPath(f"memory://lifecycle-{name}"))
    write_artifact(store.global_model("unit", RUN_ID, 0), FLModel(params={"w": np.zeros(3, np.float32)}))
    for module in (lifecycle, site_steps):
        monkeypatch.setattr(module, "store_for", lambda job: store)
    monkeypatch.setattr(lifecycle, "check_connection", lambda store, conn_id: None)
    return store


@pytest.fixture
def file_store(tmp_path: pathlib.Path) -> ModelStore:
    """The job's own store (files under the test's directory), with round 1's global model."""
    store = ModelStore(UPath(tmp_path / "store"))
    write_artifact(store.global_model("unit", RUN_ID, 0), FLModel(params={"w": np.zeros(3, np.float32)}))
    return store


@pytest.fixture
def fake_links(object_store: ModelStore, monkeypatch: pytest.MonkeyPatch) -> FakeLinks:
    """The round's store links of site-1, opened by every site task here (a shared staging's)."""
    fake = FakeLinks(object_store)
    monkeypatch.setattr(links, "stage_in_through_links", stage_in_through_fake_links)
    monkeypatch.setattr(links, "stage_out_through_links", stage_out_through_fake_links)
    monkeypatch.setattr(shared_links, "site_links", lambda *a: fake)
    return fake
