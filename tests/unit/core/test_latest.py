"""The job's ``latest.json`` read back for a warm start: the model it names, verified (the pointer's
bad shapes are the battery's: tests/bad_inputs/test_trigger_conf.py)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.latest import parse_latest_pointer, warm_start_model
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.store import ModelStore


def _published(tmp_path: pathlib.Path) -> tuple[ModelStore, pathlib.Path, str]:
    """A store with run r1's final model and the pointer publish writes for it."""
    store = ModelStore(tmp_path / "store")
    model = store.final_dir("demo", "r1") / "model.safetensors"
    record = write_artifact(model, FLModel(params={"w": np.arange(4, dtype=np.float32)}))
    pointer = store.latest_pointer("demo")
    pointer.write_text(json.dumps({"run_id": "r1", "model_uri": str(model), "sha256": record.sha256, "round": 2}))
    return store, pointer, str(model)


def test_a_warm_start_reads_the_model_the_pointer_names(tmp_path: pathlib.Path) -> None:
    store, pointer, model = _published(tmp_path)
    params, source = warm_start_model(store, pointer)
    np.testing.assert_array_equal(params["w"], np.arange(4, dtype=np.float32))
    assert source == f"warm start from run r1 ({model})"


def test_a_model_replaced_since_it_was_published_is_refused(tmp_path: pathlib.Path) -> None:
    store, pointer, model = _published(tmp_path)
    write_artifact(pathlib.Path(model), FLModel(params={"w": np.zeros(4, dtype=np.float32)}))
    with pytest.raises(FlareAirflowError, match=r"model\.safetensors changed since run r1 published it"):
        warm_start_model(store, pointer)


def test_a_sha256_in_capitals_is_not_one_publish_wrote(tmp_path: pathlib.Path) -> None:
    data = json.dumps({"run_id": "r", "model_uri": "m", "sha256": "A" * 64, "round": 1}).encode()
    with pytest.raises(FlareAirflowError, match=r"latest\.json: 'sha256' is not 64 hex digits"):
        parse_latest_pointer(data, "latest.json")
