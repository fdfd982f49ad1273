"""The run's published outputs as the runs page offers them: only where publish writes them, in a
store the deployment lists, whatever the publish task's XCom names."""

from __future__ import annotations

import hashlib
import pathlib

import pytest

from flare_airflow.core.store import ModelStore
from flare_airflow.ui import files


@pytest.fixture
def store(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> ModelStore:
    store = ModelStore(tmp_path / "store")
    monkeypatch.setattr(files, "store_roots", lambda: [store])
    return store


def test_the_outputs_publish_wrote_are_found_with_their_sha256(store: ModelStore) -> None:
    final = store.final_dir("demo", "r1")
    final.mkdir(parents=True)
    (final / "metrics.json").write_text('{"rounds": []}')
    (final / "metrics.png").write_bytes(b"\x89PNG" * 300_000)  # larger than one chunk
    found = files.published_outputs("r1", {"metrics": str(final / "metrics.json"), "plot": str(final / "metrics.png")})
    assert set(found) == {"metrics", "plot"}
    described = files.describe_downloads("", "flare_demo", "r1", {"plot": found["plot"]})
    assert described[0]["sha256"] == hashlib.sha256(b"\x89PNG" * 300_000).hexdigest()
    assert described[0]["size"] == 1_200_000 and described[0]["label"] == "metrics.png"


@pytest.mark.parametrize(
    "where",
    [
        "{root}/demo/r1/metrics.json",  # not under final/
        "{root}/demo/other-run/final/metrics.json",  # another run's
        "{outside}/demo/r1/final/metrics.json",  # a store the deployment does not list
    ],
)
def test_an_xcom_naming_another_place_finds_nothing(store: ModelStore, tmp_path: pathlib.Path, where: str) -> None:
    path = pathlib.Path(where.format(root=store.root, outside=tmp_path / "elsewhere"))
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    assert files.published_outputs("r1", {"metrics": str(path)}) == {}
