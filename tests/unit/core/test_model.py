"""The on-disk model format: safetensors + a record with sha256; never pickle; atomic writes."""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import pickle
import tracemalloc
import zipfile
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from upath import UPath

from flare_airflow.core.errors import ModelFormatError
from flare_airflow.core.model import (
    CHUNK_BYTES,
    ArtifactRecord,
    FiniteScan,
    FLModel,
    ParamsType,
    all_finite,
    atomic_write,
    parse_safetensors,
    read_artifact,
    read_into,
    read_record,
    record_path,
    write_artifact,
)
from flare_airflow.core.store import read_at_most


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


def forge(
    path: pathlib.Path, payload: bytes, num_samples: int = 10, params_type: ParamsType = ParamsType.FULL
) -> pathlib.Path:
    """Put ``payload`` where a safetensors file is expected, with a record whose checksum matches."""
    path.write_bytes(payload)
    record = ArtifactRecord(
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
        params_type=params_type,
        num_samples=num_samples,
        metrics={},
        meta={},
        tensors={"w": ("float32", (2,))},
    )
    record_path(path).write_text(record.to_json())
    return path


def raw_safetensors(
    tensors: dict[str, tuple[str, np.ndarray]], header: dict | None = None, data_start: int | None = None
) -> bytes:
    """A safetensors file laid out by hand: tensors in the given order, no alignment padding.

    ``header`` entries replace the computed ones (to forge bad offsets); with ``data_start`` the
    JSON is padded so that the data starts at that offset modulo 8 (safetensors pads to 0).
    """
    entries: dict = {}
    data = b""
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
        entries[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    entries.update(header or {})
    text = json.dumps(entries).encode()
    if data_start is not None:
        text += b" " * ((data_start - 8 - len(text)) % 8)
    return len(text).to_bytes(8, "little") + text + data


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


def test_unaligned_tensors_are_read_correctly(tmp_path: pathlib.Path) -> None:
    """Tensors at unaligned offsets (the data at 2 mod 8, 3 int8 first) come back right, as views."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    d = np.array([1e300, -2.5])
    payload = raw_safetensors(
        {"b": ("I8", np.array([1, -2, 3], np.int8)), "w": ("F32", w), "d": ("F64", d)}, data_start=2
    )
    path = forge(tmp_path / "m.safetensors", payload)
    got, _ = read_artifact(path)
    assert not got["w"].flags.aligned and not got["d"].flags.aligned
    np.testing.assert_array_equal(got["w"], w)
    np.testing.assert_array_equal(got["d"], d)
    np.testing.assert_array_equal(got["b"], [1, -2, 3])
    assert parse_safetensors(payload, "x")["w"].dtype == np.float32


def test_parse_matches_safetensors_own_loader() -> None:
    params = {**sample_params(), "flag": np.array([True, False]), "u": np.arange(5, dtype=np.uint16)}
    data = safetensors.numpy.save(params, metadata={"params_type": "FULL"})
    ours, theirs = parse_safetensors(data, "x"), safetensors.numpy.load(data)
    assert sorted(ours) == sorted(theirs)
    for name, arr in theirs.items():
        assert ours[name].dtype == arr.dtype and ours[name].shape == arr.shape
        np.testing.assert_array_equal(ours[name], arr)


W2 = ("F32", np.ones(2, np.float32))


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"\x05\x00\x00", "shorter than the 8-byte header length"),
        ((10**9).to_bytes(8, "little") + b"{}", "does not fit"),
        (raw_safetensors({"w": W2})[:-1], "the file has"),  # data shorter than the offsets say
        (raw_safetensors({"w": W2}) + b"\x00", "the tensors end at byte"),  # trailing bytes
        (raw_safetensors({"w": W2}, {"w": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 8]}}), "unsupported"),
        (raw_safetensors({"w": W2}, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), "do not hold"),
        (raw_safetensors({"w": W2}, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}), "starts at"),
        (raw_safetensors({"w": W2}, {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}), "bad shape"),
        (raw_safetensors({"w": W2}, {"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}), "bad shape"),
        (raw_safetensors({"w": W2}, {"w": {"dtype": "F32", "shape": [2]}}), "expected dtype, shape and"),
        (raw_safetensors({"w": W2}, {"__metadata__": {"a": 1}}), "__metadata__"),
        (raw_safetensors({"w": W2, "v": W2}, {"v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}), "starts"),
        (len(b"[]").to_bytes(8, "little") + b"[]", "not a JSON object"),
        (len(b'{"a":1,"a":2}').to_bytes(8, "little") + b'{"a":1,"a":2}', "duplicate keys"),
    ],
)
def test_the_safetensors_header_is_checked_strictly(tmp_path: pathlib.Path, payload: bytes, fragment: str) -> None:
    path = forge(tmp_path / "m.safetensors", payload)
    with pytest.raises(ModelFormatError, match="not a valid safetensors file") as info:
        read_artifact(path)
    assert fragment in str(info.value)


def test_a_file_longer_than_its_record_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    record = write_artifact(path, FLModel(params=sample_params()))
    path.write_bytes(path.read_bytes() + b"\x00")
    with pytest.raises(ModelFormatError, match=f"larger than the {record.size} bytes its record says"):
        read_artifact(path)


class NoReadinto:
    """A path whose files offer only ``read()``, as some object-store backends' do."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def open(self, mode: str = "rb") -> io.BytesIO:
        return ReadOnly(self.path.read_bytes())

    def exists(self) -> bool:
        return self.path.exists()

    @property
    def parent(self) -> pathlib.Path:
        return self.path.parent

    @property
    def name(self) -> str:
        return self.path.name

    def __str__(self) -> str:
        return f"noreadinto://{self.path}"


class ReadOnly(io.BytesIO):
    """A file object without ``readinto``."""

    def __getattribute__(self, name: str):
        if name == "readinto":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_files_without_readinto_are_read_whole(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    write_artifact(path, FLModel(params=sample_params()))
    assert not hasattr(NoReadinto(path).open(), "readinto")
    got, _ = read_artifact(NoReadinto(path))  # type: ignore[arg-type]
    np.testing.assert_array_equal(got["layer.weight"], sample_params()["layer.weight"])
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ModelFormatError, match="truncated"):
        read_artifact(NoReadinto(path))  # type: ignore[arg-type]


def _in_memory_store(path: pathlib.Path) -> UPath:
    """A copy of the artifact at ``path`` on fsspec's memory:// (a file object with a ``size``, no fileno)."""
    target = UPath(f"memory://claims/{path.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    for source, dest in ((path, target), (record_path(path), record_path(target))):  # type: ignore[arg-type]
        dest.write_bytes(source.read_bytes())
    return target


@pytest.mark.parametrize("where", ["local", "memory", "no-readinto"])
def test_a_record_claiming_more_bytes_than_its_file_allocates_nothing_that_large(
    tmp_path: pathlib.Path, where: str
) -> None:
    """The record is input: its size is compared with the file's before a buffer of that size exists
    (a record claiming 10^12 bytes made the site runner die of MemoryError)."""
    path = tmp_path / "m.safetensors"
    write_artifact(path, FLModel(params=sample_params()))
    claimed = 1 << 31
    raw = json.loads(record_path(path).read_text())
    record_path(path).write_text(json.dumps({**raw, "size": claimed}))
    target: Any = {"local": path, "memory": _in_memory_store(path), "no-readinto": NoReadinto(path)}[where]
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError, match=f"record says {claimed}; the file is truncated or its record"):
            read_artifact(target)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_records_are_read_at_most_to_their_limit(tmp_path: pathlib.Path) -> None:
    class Counting(io.BytesIO):
        asked = 0

        def read(self, n: int | None = -1) -> bytes:
            Counting.asked = max(Counting.asked, n or 0)
            return super().read(n)

    assert read_at_most(Counting(b"x" * 100), 10) == b"x" * 11
    assert read_at_most(Counting(b"abc"), 10) == b"abc"
    assert Counting.asked <= 11


def test_all_finite_finds_a_nan_deep_inside_a_large_tensor() -> None:
    big = np.zeros(3 * CHUNK_BYTES // 4 + 5, np.float32)  # 3 chunks and a bit
    assert all_finite({"big": big}) is None
    big[2 * CHUNK_BYTES // 4 + 1] = np.nan
    assert all_finite({"ok": np.ones(3), "big": big}) == "big"
    big[:] = 0
    big[-1] = -np.inf
    assert all_finite({"big": big}) == "big"


@pytest.mark.parametrize("piece", [1, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("bad", [None, "h", "w", "d"])
def test_finite_scan_sees_every_element_whatever_the_pieces(piece: int, bad: str | None) -> None:
    """Pieces that split the header and elements, unaligned tensors, integer tensors between floats."""
    tensors = {
        "i": ("I8", np.array([1, 2, 3], np.int8)),
        "h": ("F16", np.arange(5, dtype=np.float16)),
        "w": ("F32", np.ones((3, 4), np.float32)),
        "n": ("I64", np.array([7], np.int64)),
        "d": ("F64", np.zeros(6)),
        "e": ("F32", np.zeros(0, np.float32)),
    }
    if bad is not None:
        tensors[bad][1].reshape(-1)[-1] = np.nan if bad != "w" else -np.inf  # the very last element
    data = raw_safetensors(tensors, data_start=5)
    scan = FiniteScan()
    for upto in [*range(piece, len(data), piece), len(data)]:
        scan.feed(data, upto)
    assert scan.bad == bad


def test_finite_scan_through_read_into(tmp_path: pathlib.Path) -> None:
    params = {"a": np.zeros(3 * CHUNK_BYTES // 8 + 3), "b": np.ones(5, np.float32)}
    params["a"][2 * CHUNK_BYTES // 8 + 1] = np.inf
    path = tmp_path / "m.safetensors"
    record = write_artifact(path, FLModel(params=params))
    scan = FiniteScan()
    read_into(path, record.size, None, scan)
    assert scan.bad == "a"
    scan = FiniteScan()
    read_into(NoReadinto(path), record.size, None, scan)  # type: ignore[arg-type]
    assert scan.bad == "a"
    scan = FiniteScan()
    forge(path, b"\x80 not safetensors")
    read_into(path, path.stat().st_size, None, scan)
    assert scan.bad is None


def test_records_hold_sha256_and_blake3_of_the_tensors_file(tmp_path: pathlib.Path) -> None:
    import blake3

    path = tmp_path / "m.safetensors"
    record = write_artifact(path, FLModel(params=sample_params()))
    data = path.read_bytes()
    raw = json.loads(record_path(path).read_text())
    assert raw["sha256"] == record.sha256 == hashlib.sha256(data).hexdigest()
    assert raw["blake3"] == record.blake3 == blake3.blake3(data).hexdigest()
    assert read_record(path) == record


def test_every_recorded_digest_is_verified(tmp_path: pathlib.Path) -> None:
    """A record whose sha256 matches but whose BLAKE3 does not is refused: reads check both."""
    path = tmp_path / "m.safetensors"
    write_artifact(path, FLModel(params=sample_params()))
    raw = json.loads(record_path(path).read_text())
    raw["blake3"] = "0" * 64
    record_path(path).write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match=r"blake3 [0-9a-f]{12}… does not match its record 000000000000…"):
        read_artifact(path)


@pytest.mark.parametrize("value", ["abc", 7, "G" * 64])
def test_a_malformed_blake3_makes_the_record_unreadable(tmp_path: pathlib.Path, value: object) -> None:
    path = tmp_path / "m.safetensors"
    write_artifact(path, FLModel(params=sample_params()))
    raw = json.loads(record_path(path).read_text())
    raw["blake3"] = value
    record_path(path).write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match=r"unreadable artifact record \(blake3 must be 64 hex digits"):
        read_artifact(path)


@pytest.mark.parametrize(
    "params",
    [
        {"w": np.arange(12, dtype=np.float32).reshape(3, 4)},
        {
            "z.bias": np.ones(3, np.float16),
            "a": np.arange(5, dtype=np.int8),
            "m": np.array(2.5),  # 0-d float64
            "flag": np.array([True, False]),
            "q": np.arange(4, dtype=np.uint8),
            "empty": np.zeros((0, 3), np.float32),
            "cx": np.ones(2, np.complex64),
            "i64": np.arange(3, dtype=np.int64),
            "u32": np.arange(3, dtype=np.uint32),
            'caf\u00e9 "quoted"': np.ones(1, np.float32),
            "big-endian": np.arange(3, dtype=">f4"),
            "strided": np.arange(10, dtype=np.float64)[::2],
        },
        {},
    ],
    ids=["one", "every-dtype", "none"],
)
def test_written_files_are_byte_for_byte_what_safetensors_writes(tmp_path: pathlib.Path, params) -> None:
    """write_artifact streams the arrays' memory instead of serialising a copy; the file must stay
    exactly safetensors' own serialisation (its digests are published and compared across runs)."""
    record = write_artifact(tmp_path / "m.safetensors", FLModel(params=params, params_type=ParamsType.DIFF))
    expected = safetensors.numpy.save(
        {k: np.ascontiguousarray(v) if v.ndim else v for k, v in params.items()}, metadata={"params_type": "DIFF"}
    )
    data = (tmp_path / "m.safetensors").read_bytes()
    assert data == expected and record.size == len(data)
    assert record.sha256 == hashlib.sha256(data).hexdigest()
    back, _ = read_artifact(tmp_path / "m.safetensors")
    assert sorted(back) == sorted(params) and all(np.array_equal(back[k], v) for k, v in params.items())


def test_a_bad_metric_is_refused_before_the_tensors_file_is_replaced(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.safetensors"
    first = write_artifact(path, FLModel(params={"w": np.ones(2, np.float32)}))
    with pytest.raises(ModelFormatError, match="metric"):
        write_artifact(path, FLModel(params={"w": np.zeros(2, np.float32)}, metrics={"loss": float("nan")}))
    assert read_artifact(path)[1] == first
