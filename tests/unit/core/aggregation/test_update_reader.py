"""core/aggregation/update_reader.py: what an update must be to count, and the reader that verifies it in the
store (the reader's whole path is exercised through fedavg_from_store in test_streaming.py)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from flare_airflow.core.aggregation.update_reader import UpdateReader, update_weight, validate_update
from flare_airflow.core.errors import UpdateRejected
from flare_airflow.core.model import ArtifactRecord, FLModel, ParamsType, tensor_spec, write_artifact

GLOBAL = {"w": np.zeros(3, np.float32)}


def record(num_samples: int | None) -> ArtifactRecord:
    return ArtifactRecord(
        sha256="0" * 64, size=0, params_type=ParamsType.FULL, num_samples=num_samples, metrics={}, meta={},
        tensors={},
    )  # fmt: skip


def test_the_weight_is_samples_times_the_site_weight_and_must_be_finite_and_positive() -> None:
    assert update_weight("a", record(4), {"a": 0.5}) == (2.0, None)
    assert update_weight("a", record(None), {}) == (1.0, None)  # no num_samples: counts once
    _, refused = update_weight("a", record(4), {"a": float("inf")})
    assert refused is not None and "must be finite and > 0" in refused.reason


def test_an_update_must_match_the_global_models_tensors_and_be_finite() -> None:
    spec = tensor_spec(GLOBAL)
    validate_update("a", spec, {"w": np.ones(3, np.float32)})
    with pytest.raises(UpdateRejected, match=r"tensor 'w' has shape \(4,\)"):
        validate_update("a", spec, {"w": np.ones(4, np.float32)})
    with pytest.raises(UpdateRejected, match="NaN or infinite"):
        validate_update("a", spec, {"w": np.array([1, np.nan, 0], np.float32)})


def test_the_reader_refuses_an_update_its_site_task_did_not_accept(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "a.safetensors"
    rec = write_artifact(path, FLModel(params={"w": np.ones(3, np.float32)}))
    reader = UpdateReader(tensor_spec(GLOBAL), {"a": rec.sha256}, None)
    _, params, _, why = reader.read(0, "a", path, None)
    assert why is None and params["w"].tolist() == [1.0, 1.0, 1.0]
    replaced = UpdateReader(tensor_spec(GLOBAL), {"a": "f" * 64}, None)
    assert "is not the update its site task accepted" in str(replaced.read(0, "a", path, None)[3])
