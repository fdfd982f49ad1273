"""operators/staging.py: object-store models as local files for the trainer, and the store's connection.

The object store here is fsspec's in-memory filesystem (``memory://`` through universal-pathlib, which
the store accepts like Airflow's ObjectStoragePath), a real fsspec backend: what differs from S3 is
the transport and the connection, which the e2e tier covers (tests/e2e/test_edge_sites.py).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from airflow.sdk import ObjectStoragePath
from upath import UPath

from flare_airflow.core.errors import StoreError
from flare_airflow.core.failure_record import write_failure
from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import ModelStore, failure_path, record_path
from flare_airflow.operators.staging import check_connection, staged, unusable_store
from flare_airflow.site_task.spec import SiteRun


def _run(store: ModelStore, try_number: int = 1) -> SiteRun:
    return SiteRun(
        job="j",
        run_id="r",
        round=1,
        total_rounds=1,
        site="site-1",
        task="train",
        argv=["python", "t.py"],
        global_model=str(store.global_model("j", "r", 0)),
        output=str(store.site_update("j", "r", 1, "site-1")),
        staging=str(store.staging("j", "r", 1, "site-1", try_number)),
    )


@pytest.fixture
def memory_store(request) -> ModelStore:
    store = ModelStore(UPath(f"memory://flare-{request.node.name}"))
    write_artifact(store.global_model("j", "r", 0), FLModel(params={"w": np.arange(4, dtype=np.float32)}))
    return store


def test_a_local_store_is_not_staged(tmp_path) -> None:
    store = ModelStore(ObjectStoragePath(f"file://{tmp_path}"))
    run = _run(store)
    with staged(run, store) as local:
        assert local is run


def test_the_aggregation_reads_a_local_object_storage_path_with_plain_open(tmp_path) -> None:
    """What the aggregation task passes for a file:// store: read with open(), not through fsspec."""
    import io

    from flare_airflow.core.store import local_file, open_for_reading

    store = ModelStore(ObjectStoragePath(f"file://{tmp_path}"))
    path = store.global_model("j", "r", 0)
    write_artifact(path, FLModel(params={"w": np.arange(4, dtype=np.float32)}))
    assert local_file(path) == str(tmp_path / "j" / "r" / "round-0000" / "global.safetensors")
    with open_for_reading(path) as fh:
        assert isinstance(fh, io.FileIO)
    assert read_artifact(path)[0]["w"].tolist() == [0, 1, 2, 3]


def test_the_trainer_gets_local_files_and_the_update_goes_up_with_its_record_last(memory_store) -> None:
    run = _run(memory_store)
    with staged(run, memory_store) as local:
        for path in (local.global_model, local.output, local.staging):
            assert path is not None and not path.startswith("memory://")
        model, _ = read_artifact(pathlib.Path(local.global_model))
        assert model["w"].tolist() == [0, 1, 2, 3]
        assert pathlib.Path(local.staging or "").parts[-3:] == ("site-1", "try-1", "update.safetensors")
        write_artifact(
            pathlib.Path(local.output), FLModel(params={"w": np.ones(4, np.float32)}, meta={"num_samples": 3})
        )
        root = pathlib.Path(local.global_model).parents[1]
    assert not root.exists()  # the local copy is gone
    remote = memory_store.resolve_uri(run.output)
    params, record = read_artifact(remote)  # verified against its record
    assert params["w"].tolist() == [1, 1, 1, 1] and record.num_samples == 3


def test_a_failure_record_goes_up_and_a_previous_update_is_cleared(memory_store) -> None:
    run = _run(memory_store)
    remote = memory_store.resolve_uri(run.output)
    write_artifact(remote, FLModel(params={"w": np.zeros(4, np.float32)}))  # an earlier try's update
    with staged(run, memory_store) as local:
        assert not remote.exists() and not record_path(remote).exists()
        write_failure(pathlib.Path(local.output), JobReturnCode.EXECUTION_ERROR, "trainer failed: exit 1")
    assert "trainer failed: exit 1" in failure_path(remote).read_text()
    assert not remote.exists()


def test_an_object_store_needs_a_named_connection_defined_here(memory_store, monkeypatch) -> None:
    check_connection(ModelStore(pathlib.Path("/tmp")), None)  # a local store needs none
    with pytest.raises(StoreError, match="names no connection for it: set store_conn_id"):
        check_connection(memory_store, None)
    monkeypatch.delenv("AIRFLOW_CONN_SITE_STORE", raising=False)
    with pytest.raises(
        StoreError, match=r"connection 'site_store' is not defined on this worker.*AIRFLOW_CONN_SITE_STORE"
    ):
        check_connection(memory_store, "site_store")
    monkeypatch.setenv("AIRFLOW_CONN_SITE_STORE", '{"conn_type": "aws", "login": "k", "password": "s"}')
    check_connection(memory_store, "site_store")


def test_an_unusable_store_says_through_what_and_what_to_check(memory_store) -> None:
    refused = PermissionError("AccessDenied:\n  403")
    by_links = unusable_store(memory_store, refused, through_links=True, conn_id="site_store")
    assert "(its store links): PermissionError: AccessDenied: 403;" in by_links and "mint new ones" in by_links
    by_conn = unusable_store(memory_store, refused, through_links=False, conn_id="site_store")
    assert "(connection 'site_store')" in by_conn and "credentials and endpoint" in by_conn
    assert by_conn.endswith("[INFRASTRUCTURE_ERROR]") and str(memory_store.root) in by_conn
