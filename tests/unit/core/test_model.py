"""The on-disk model format: safetensors + a record with sha256; never pickle; atomic writes."""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import pickle
import zipfile

import numpy as np
import pytest
from upath import UPath

from flare_airflow.core.errors import ModelFormatError
from flare_airflow.core.model import (
    ArtifactRecord,
    FLModel,
    ParamsType,
    all_finite,
    atomic_write,
    read_artifact,
    read_record,
    record_path,
    write_artifact,
)


def sample_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "layer.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "layer.bias": np.arange(3, dtype=np.int64),
        "half": np.array([1.5, -2.25], dtype=np.float16),
        "scalar": np.array(3.0, dtype=np.float64),
    }


@pytest.mark.parametrize("params_type", [ParamsType.FULL, ParamsType.DIFF])
def test_round_trip(tmp_path: pathlib.Path, params_type: ParamsType) -> None:
    path = tmp_path / "m.safetensors"
    params = sample_params()
    model = FLModel(
        params=params,
        params_type=params_type,
        metrics={"loss": 0.25, "acc": np.float32(0.5), "steps": 10},
        meta={"num_samples": np.int64(42), "note": "hello"},
    )
    written = write_artifact(path, model)
    got, record = read_artifact(path)
    assert record == written
    assert set(got) == set(params)
    for name, arr in params.items():
        assert got[name].dtype == arr.dtype
        assert got[name].shape == arr.shape
        np.testing.assert_array_equal(got[name], arr)
    assert record.params_type is params_type
    assert record.num_samples == 42 and type(record.num_samples) is int
    assert record.metrics == {"loss": 0.25, "acc": 0.5, "steps": 10.0}
    assert record.meta == {"note": "hello"}
    assert record.tensors == {
        "layer.weight": ("float32", (4, 3)),
        "layer.bias": ("int64", (3,)),
        "half": ("float16", (2,)),
        "scalar": ("float64", ()),
    }
    data = path.read_bytes()
    assert record.size == len(data)
    assert record.sha256 == hashlib.sha256(data).hexdigest()
    assert read_record(path) == record
    raw = json.loads(record_path(path).read_text())
    assert raw["format"] == "flare-airflow/1"
    assert raw["params_type"] == params_type.value


def test_num_samples_is_optional(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    write_artifact(path, FLModel(params={"w": np.zeros(2, np.float32)}))
    assert read_artifact(path)[1].num_samples is None


def test_record_path_is_next_to_the_tensors(tmp_path: pathlib.Path) -> None:
    assert record_path(tmp_path / "a" / "site-1.safetensors") == tmp_path / "a" / "site-1.json"


def test_flipped_byte_fails_the_checksum(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    write_artifact(path, FLModel(params=sample_params()))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # inside the tensor data: still a parseable safetensors file
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=r"sha256 .* does not match its record") as info:
        read_artifact(path)
    assert str(path) in str(info.value)


def test_truncated_file_is_detected(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    record = write_artifact(path, FLModel(params=sample_params()))
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ModelFormatError, match="truncated") as info:
        read_artifact(path)
    assert f"{record.size - 7} bytes, record says {record.size}" in str(info.value)


def test_missing_record_means_incomplete(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    write_artifact(path, FLModel(params=sample_params()))
    record_path(path).unlink()
    with pytest.raises(ModelFormatError, match=r"no artifact record m\.json \(the artifact was never completed\)"):
        read_artifact(path)


def test_missing_tensors_with_a_record(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    write_artifact(path, FLModel(params=sample_params()))
    path.unlink()
    with pytest.raises(ModelFormatError, match="tensors file is missing"):
        read_artifact(path)


@pytest.mark.parametrize("text", ["{not json", '{"format": "other/9"}', '{"format": "flare-airflow/1"}'])
def test_unreadable_record(tmp_path: pathlib.Path, text: str) -> None:
    path = tmp_path / "m.safetensors"
    write_artifact(path, FLModel(params=sample_params()))
    record_path(path).write_text(text)
    with pytest.raises(ModelFormatError, match="unreadable artifact record"):
        read_artifact(path)


def forge(path: pathlib.Path, payload: bytes) -> None:
    """Put ``payload`` where a safetensors file is expected, with a record whose checksum matches."""
    path.write_bytes(payload)
    record = ArtifactRecord(
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
        params_type=ParamsType.FULL,
        num_samples=10,
        metrics={},
        meta={},
        tensors={"w": ("float32", (2,))},
    )
    record_path(path).write_text(record.to_json())


def test_pickle_payload_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    forge(path, pickle.dumps({"w": np.ones(2, np.float32), "b": np.zeros(3, np.float32)}))
    with pytest.raises(ModelFormatError, match="pickle") as info:
        read_artifact(path)
    assert "only safetensors files are accepted" in str(info.value)


def test_torch_save_zip_payload_is_refused(tmp_path: pathlib.Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"w": [1.0, 2.0]}))
    path = tmp_path / "m.safetensors"
    forge(path, buf.getvalue())
    with pytest.raises(ModelFormatError, match=r"pickle/torch\.save payload"):
        read_artifact(path)


def test_garbage_payload_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    forge(path, b"hello, this is not a model" * 4)
    with pytest.raises(ModelFormatError, match="not a valid safetensors file"):
        read_artifact(path)


@pytest.mark.parametrize("num_samples", [0, -3, 2.5, True, "10", np.float64(3.0)])
def test_num_samples_must_be_a_positive_int(tmp_path: pathlib.Path, num_samples) -> None:
    path = tmp_path / "m.safetensors"
    model = FLModel(params={"w": np.zeros(2, np.float32)}, meta={"num_samples": num_samples})
    with pytest.raises(ModelFormatError, match=r"meta\['num_samples'\] must be a positive integer"):
        write_artifact(path, model)
    assert list(tmp_path.iterdir()) == [], "a refused model must not leave files behind"


@pytest.mark.parametrize("value", ["high", None, [1.0], True, {"a": 1}])
def test_non_numeric_metric_is_refused(tmp_path: pathlib.Path, value) -> None:
    path = tmp_path / "m.safetensors"
    model = FLModel(params={"w": np.zeros(2, np.float32)}, metrics={"loss": 0.1, "quality": value})
    with pytest.raises(ModelFormatError, match="metric 'quality' must be a number"):
        write_artifact(path, model)
    assert list(tmp_path.iterdir()) == []


def test_object_arrays_and_unserialisable_meta_are_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    with pytest.raises(ModelFormatError, match="dtype object"):
        write_artifact(path, FLModel(params={"w": np.array([1, "a"], dtype=object)}))
    with pytest.raises(ModelFormatError, match="JSON-serialisable"):
        write_artifact(path, FLModel(params={"w": np.zeros(2)}, meta={"when": object()}))
    assert list(tmp_path.iterdir()) == []


def test_atomic_writes_leave_no_temporary_files(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "deep" / "dir" / "m.safetensors"
    for i in range(3):
        write_artifact(path, FLModel(params={"w": np.full(4, i, np.float32)}, meta={"num_samples": i + 1}))
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.json", "m.safetensors"]
    params, record = read_artifact(path)
    np.testing.assert_array_equal(params["w"], np.full(4, 2, np.float32))
    assert record.num_samples == 3
    atomic_write(tmp_path / "x.bin", b"abc")
    assert (tmp_path / "x.bin").read_bytes() == b"abc"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_non_contiguous_arrays_are_stored(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_artifact(path, FLModel(params={"t": base.T, "s": base[:, ::2]}))
    got, _ = read_artifact(path)
    np.testing.assert_array_equal(got["t"], base.T)
    np.testing.assert_array_equal(got["s"], base[:, ::2])


def test_object_store_paths_round_trip() -> None:
    """A non-local path (fsspec's in-memory filesystem through universal-pathlib) cannot rename."""
    path = UPath("memory://flare-model-test/run/m.safetensors")
    params = sample_params()
    write_artifact(path, FLModel(params=params, meta={"num_samples": 3}))
    got, record = read_artifact(path)
    assert record.num_samples == 3
    np.testing.assert_array_equal(got["layer.weight"], params["layer.weight"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.json", "m.safetensors"]


def test_all_finite() -> None:
    assert all_finite({"a": np.ones(3), "i": np.arange(3)}) is None
    assert all_finite({"a": np.ones(3), "b": np.array([1.0, np.nan])}) == "b"
    assert all_finite({"c": np.array([np.inf], np.float32)}) == "c"
    assert all_finite({"z": np.array([1 + 1j, complex(0, np.inf)])}) == "z"


def test_zero_dim_tensors_keep_their_shape(tmp_path: pathlib.Path) -> None:
    """A 0-d tensor (e.g. BatchNorm's num_batches_tracked) must not come back as shape (1,)."""
    path = tmp_path / "m.safetensors"
    record = write_artifact(path, FLModel(params={"steps": np.array(7, np.int64), "w": np.zeros((2, 2))}))
    got, _ = read_artifact(path)
    assert got["steps"].shape == ()
    assert int(got["steps"]) == 7
    assert record.tensors["steps"] == ("int64", ())
