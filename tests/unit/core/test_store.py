"""The model store: layout, safe path components, and no path outside the root."""

from __future__ import annotations

import io
import os
import pathlib
import re
from typing import Any

import numpy as np
import pytest
from upath import UPath

from flare_airflow.core.errors import ModelFormatError, StoreError
from flare_airflow.core.model import FLModel, read_artifact, read_record, write_artifact
from flare_airflow.core.store import (
    ModelStore,
    local_file,
    open_for_reading,
    path_from_uri,
    run_component,
    safe_component,
)

AIRFLOW_RUN_ID = "manual__2024-06-01T12:00:00.123456+00:00"


@pytest.fixture
def store(tmp_path: pathlib.Path) -> ModelStore:
    return ModelStore(tmp_path / "store")


def test_layout(store: ModelStore) -> None:
    root = store.root
    run = root / "digits" / "run-1"
    assert store.run_dir("digits", "run-1") == run
    assert store.round_dir("digits", "run-1", 0) == run / "round-0000"
    assert store.global_model("digits", "run-1", 0) == run / "round-0000" / "global.safetensors"
    assert store.global_model("digits", "run-1", 12) == run / "round-0012" / "global.safetensors"
    assert store.site_update("digits", "run-1", 3, "site-2") == run / "round-0003" / "sites" / "site-2.safetensors"
    assert store.evaluation("digits", "run-1", 5) == run / "round-0005" / "evaluation.safetensors"
    assert store.final_dir("digits", "run-1") == run / "final"
    assert store.latest_pointer("digits") == root / "digits" / "latest.json"


def test_negative_round_is_refused(store: ModelStore) -> None:
    with pytest.raises(StoreError, match="round must be >= 0"):
        store.round_dir("digits", "run-1", -1)


def test_airflow_run_ids_become_safe_readable_components(store: ModelStore) -> None:
    comp = run_component(AIRFLOW_RUN_ID)
    assert ":" not in comp and "+" not in comp and "/" not in comp
    assert comp.startswith("manual__2024-06-01T12_00_00.123456_00_00-")
    assert safe_component(comp, "run") == comp
    assert run_component(AIRFLOW_RUN_ID) == comp, "the mapping must be stable"
    run_dir = store.run_dir("digits", AIRFLOW_RUN_ID)
    assert run_dir.parent == store.root / "digits"
    assert run_dir.name == comp


def test_clean_run_ids_are_kept_verbatim() -> None:
    for run_id in ("run-1", "scheduled_2024", "v1.2", "abc-def"):
        assert run_component(run_id) == run_id


def test_run_ids_map_to_unique_components() -> None:
    colon = run_component("a:b")
    ids = ["a:b", "a+b", "a_b", "a b", "a/b", "a__b", "a:b:", colon, "x" * 200, "x" * 199 + "y", "..", ".", ""]
    comps = [run_component(run_id) for run_id in ids]
    assert len(set(comps)) == len(ids), dict(zip(ids, comps, strict=True))
    for comp in comps:
        assert safe_component(comp, "run") == comp
        assert len(comp) <= 128


@pytest.mark.parametrize("bad", ["..", ".", "", "a/b", "../x", "/etc", "a..b", ".hidden", "-x", "x" * 129, "a\\b"])
def test_safe_component_refuses(bad: str) -> None:
    with pytest.raises(StoreError, match="cannot be a store path component"):
        safe_component(bad, "site")


@pytest.mark.parametrize("good", ["site-1", "job_2.v3", "A", "x" * 128])
def test_safe_component_accepts(good: str) -> None:
    assert safe_component(good, "site") == good


def test_bad_job_and_site_names_never_reach_the_filesystem(store: ModelStore) -> None:
    with pytest.raises(StoreError, match=re.escape("job name '../x'")):
        store.run_dir("../x", "run")
    with pytest.raises(StoreError, match=re.escape("site '../../etc/passwd'")):
        store.site_update("digits", "run", 1, "../../etc/passwd")
    with pytest.raises(StoreError, match="job name ''"):
        store.latest_pointer("")


def test_resolve_uri_inside_the_root(store: ModelStore) -> None:
    inside = store.global_model("digits", "run", 1)
    assert store.resolve_uri(str(inside)) == inside
    assert store.resolve_uri("file://" + str(inside)) == inside
    assert store.resolve_uri(str(store.root)) == store.root
    assert store.checked(inside) == inside


@pytest.mark.parametrize(
    "target",
    [
        "{root}/../x",
        "{root}/digits/../../x",
        "/etc/passwd",
        "file:///etc/passwd",
        "{root}-sibling/x",  # shares the root's name as a prefix but is not inside it
        "relative/path",
    ],
)
def test_resolve_uri_outside_the_root(store: ModelStore, target: str) -> None:
    uri = target.format(root=store.root)
    with pytest.raises(StoreError, match="outside the model store root"):
        store.resolve_uri(uri)
    with pytest.raises(StoreError, match="outside the model store root"):
        store.checked(path_from_uri(uri))


def test_symlink_inside_the_root_pointing_outside(store: ModelStore, tmp_path: pathlib.Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.safetensors").write_bytes(b"x")
    store.root.mkdir(parents=True)
    (store.root / "escape").symlink_to(outside, target_is_directory=True)
    (store.root / "inner").mkdir()
    (store.root / "alias").symlink_to(store.root / "inner", target_is_directory=True)
    with pytest.raises(StoreError, match="outside the model store root"):
        store.resolve_uri(str(store.root / "escape" / "secret.safetensors"))
    with pytest.raises(StoreError):
        store.checked(store.root / "escape")
    # A link that stays inside the root is fine.
    assert store.resolve_uri(str(store.root / "alias" / "m.safetensors")) == store.root / "alias" / "m.safetensors"


def test_a_store_whose_root_is_a_symlink(tmp_path: pathlib.Path) -> None:
    real = tmp_path / "real-store"
    real.mkdir()
    link = tmp_path / "link-store"
    link.symlink_to(real, target_is_directory=True)
    store = ModelStore(link)
    assert store.resolve_uri(str(real / "digits" / "x")) == real / "digits" / "x"
    assert store.resolve_uri(str(link / "digits" / "x")) == link / "digits" / "x"


def test_pathlib_roots_read_and_write(tmp_path: pathlib.Path) -> None:
    for store in (
        ModelStore(tmp_path / "a"),
        ModelStore.from_uri(str(tmp_path / "b")),
        ModelStore.from_uri("file://" + str(tmp_path / "c")),
    ):
        assert isinstance(store.root, pathlib.Path)
        path = store.site_update("digits", AIRFLOW_RUN_ID, 1, "site-1")
        assert isinstance(path, pathlib.Path)
        write_artifact(path, FLModel(params={"w": np.arange(3, dtype=np.float32)}, meta={"num_samples": 2}))
        got, record = read_artifact(store.resolve_uri(str(path)))
        np.testing.assert_array_equal(got["w"], np.arange(3, dtype=np.float32))
        assert record.num_samples == 2
        assert os.path.realpath(path).startswith(os.path.realpath(store.root) + os.sep)
    assert "ModelStore(" in repr(store)


def test_object_store_roots() -> None:
    """A non-local root (universal-pathlib's memory:// filesystem, as used for s3:// and friends)."""
    store = ModelStore(UPath("memory://flare-store-test/root"))
    path = store.global_model("digits", "run-1", 0)
    assert str(path) == "memory://flare-store-test/root/digits/run-1/round-0000/global.safetensors"
    write_artifact(path, FLModel(params={"w": np.ones(2, np.float32)}))
    got, _ = read_artifact(store.resolve_uri(str(path)))
    np.testing.assert_array_equal(got["w"], np.ones(2, np.float32))
    with pytest.raises(StoreError, match=re.escape("contains '..'")):
        store.resolve_uri("memory://flare-store-test/root/../x")
    with pytest.raises(StoreError, match="outside the model store root"):
        store.resolve_uri("memory://flare-store-test/rootless/x")


def test_local_files_are_read_with_plain_open(tmp_path: pathlib.Path) -> None:
    """file:// paths (pathlib, UPath, Airflow's ObjectStoragePath) are opened with open(): fsspec's open
    costs ~0.8 ms per call, and the aggregation opens two files per update. Other stores keep theirs."""
    path = tmp_path / "u.safetensors"
    write_artifact(path, FLModel(params={"w": np.arange(4, dtype=np.float32)}, meta={"num_samples": 3}))
    as_uri = UPath("file://" + str(path))
    assert local_file(path) == str(path)
    assert local_file(as_uri) == str(path)
    with open_for_reading(as_uri) as fh:
        assert isinstance(fh, io.FileIO)  # unbuffered plain file, not an fsspec wrapper
        assert fh.read(8) == path.read_bytes()[:8]
    got, record = read_artifact(as_uri)
    np.testing.assert_array_equal(got["w"], np.arange(4, dtype=np.float32))
    assert record.num_samples == 3

    remote = UPath("memory://flare-store-test/local-files/u.safetensors")
    assert local_file(remote) is None
    write_artifact(remote, FLModel(params={"w": np.ones(2, np.float32)}))
    with open_for_reading(remote) as fh:
        assert not isinstance(fh, io.FileIO)
    np.testing.assert_array_equal(read_artifact(remote)[0]["w"], np.ones(2, np.float32))


@pytest.mark.parametrize("where", ["local", "file-uri", "memory"])
def test_a_missing_record_is_named_on_every_store(tmp_path: pathlib.Path, where: str) -> None:
    """read_record opens the record without asking exists() first: a missing one still says so."""
    path: Any = {
        "local": tmp_path / "x.safetensors",
        "file-uri": UPath("file://" + str(tmp_path / "x.safetensors")),
        "memory": UPath("memory://flare-store-test/missing/x.safetensors"),
    }[where]
    with pytest.raises(ModelFormatError, match=r"no artifact record x\.json \(the artifact was never completed\)"):
        read_record(path)
