"""Update files and records a site (or a trainer bypassing the Client API) can leave: each rejects
that site only -- never the round -- and never reaches the global model.

Every case writes one good update (site-1) and one bad one (site-2), then runs the aggregation
as the aggregation task does (``fedavg_from_store`` with the sha256 each site task accepted).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import pickle
import struct
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from flare_airflow.core.aggregation.streaming import fedavg_from_store
from flare_airflow.core.errors import AggregateNotFinite, ModelFormatError
from flare_airflow.core.model import FLModel, ParamsType, all_finite, read_record, record_path, write_artifact
from tests.bad_inputs.cases import Case, assert_clear

GLOBAL = {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}


def good_params(value: float = 1.0) -> dict[str, np.ndarray]:
    return {"w": np.full(4, value, np.float32), "b": np.full(2, value, np.float32)}


def write(path: pathlib.Path, params: dict, **meta) -> pathlib.Path:
    write_artifact(path, FLModel(params=params, meta={"num_samples": 5, **meta}))
    return path


def edit_record(path: pathlib.Path, change: Callable[[dict], None]) -> None:
    rec = record_path(path)
    raw = json.loads(rec.read_text())
    change(raw)
    rec.write_text(json.dumps(raw))


def set_record(key: str, value: object) -> Callable[[pathlib.Path], None]:
    return lambda p: edit_record(p, lambda r: r.__setitem__(key, value))


def raw_record(text: str) -> Callable[[pathlib.Path], None]:
    return lambda p: record_path(p).write_text(text)


def replace_tensors(data: bytes, fix_record: bool = True) -> Callable[[pathlib.Path], None]:
    def apply(p: pathlib.Path) -> None:
        p.write_bytes(data)
        if fix_record:
            edit_record(p, lambda r: r.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data)))

    return apply


def safetensors_bytes(header: object, payload: bytes = b"") -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    h = text.encode()
    return struct.pack("<Q", len(h)) + h + payload


def resend(params: dict, **meta) -> Callable[[pathlib.Path], None]:
    return lambda p: write(p, params, **meta)


def resend_raw(params: dict, record_change: Callable[[dict], None]) -> Callable[[pathlib.Path], None]:
    def apply(p: pathlib.Path) -> None:
        write(p, params)
        edit_record(p, record_change)

    return apply


def raw_record_sub(old: str, new: str) -> Callable[[pathlib.Path], None]:
    def apply(p: pathlib.Path) -> None:
        rec = record_path(p)
        text = json.dumps(json.loads(rec.read_text()), sort_keys=True)
        assert old in text, (old, text)
        rec.write_text(text.replace(old, new))

    return apply


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


_W = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
_B = {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}
_FLOATS = b"\0" * 24

# id -> (what the bad site did, the error text, how its files are damaged)
BAD: dict[str, tuple[str, str, Callable[[pathlib.Path], None]]] = {
    "update-nan": (
        "a tensor holds NaN",
        "contains NaN or infinite values",
        resend({**good_params(), "w": np.full(4, np.nan, np.float32)}),
    ),
    "update-inf": (
        "a tensor holds +inf",
        "contains NaN or infinite values",
        resend({**good_params(), "b": np.full(2, np.inf, np.float32)}),
    ),
    "update-missing-tensor": (
        "a tensor of the global model is missing",
        "missing ['b']",
        resend({"w": good_params()["w"]}),
    ),
    "update-extra-tensor": (
        "an extra tensor",
        "unexpected ['x']",
        resend({**good_params(), "x": np.zeros(1, np.float32)}),
    ),
    "update-wrong-shape": (
        "a tensor has another shape",
        "has shape (5,), the global model has (4,)",
        resend({**good_params(), "w": np.zeros(5, np.float32)}),
    ),
    "update-wrong-dtype": (
        "a tensor has another dtype",
        "has dtype float64, the global model has float32",
        resend({**good_params(), "w": np.zeros(4, np.float64)}),
    ),
    "update-pickle": (
        "the tensors file is a pickle with a matching record",
        "pickle/torch.save payload",
        replace_tensors(pickle.dumps(good_params())),
    ),
    "update-truncated": ("the tensors file is cut short", "bytes", lambda p: p.write_bytes(p.read_bytes()[:-5])),
    "update-bit-flip": (
        "one byte of the tensors changed after the record was written",
        "does not match its record",
        lambda p: p.write_bytes(p.read_bytes()[:-1] + b"\x01"),
    ),
    "update-empty-file": (
        "the tensors file is empty, the record claims 0 bytes",
        "shorter than the 8-byte header length",
        replace_tensors(b""),
    ),
    "update-tensors-missing": (
        "the record exists, the tensors file does not",
        "cannot read the update (No such file or directory)",
        lambda p: p.unlink(),
    ),
    "update-header-too-long": (
        "the header length exceeds the file",
        "does not fit",
        replace_tensors(struct.pack("<Q", 1 << 40) + b"{}"),
    ),
    "update-header-not-json": (
        "the header is not JSON",
        "not a valid safetensors file",
        replace_tensors(safetensors_bytes("{not json")),
    ),
    "update-header-deeply-nested": (
        "the header is 100 000 nested JSON arrays",
        "nested too deeply",
        replace_tensors(safetensors_bytes(nested(100_000))),
    ),
    "update-header-list": (
        "the header is a JSON list",
        "the header is not a JSON object",
        replace_tensors(safetensors_bytes([1, 2])),
    ),
    "update-header-unknown-dtype": (
        "a tensor's dtype is unknown",
        "unsupported dtype 'F128'",
        replace_tensors(safetensors_bytes({"w": {**_W, "dtype": "F128"}, "b": _B}, _FLOATS)),
    ),
    "update-header-float8": (
        "a tensor is float8 (no format this project trains in)",
        "unsupported dtype 'F8_E4M3'",
        replace_tensors(
            safetensors_bytes(
                {"w": {**_W, "dtype": "F8_E4M3", "data_offsets": [0, 4]}, "b": {**_B, "data_offsets": [4, 12]}},
                b"\0" * 12,
            )
        ),
    ),
    "update-bf16-for-float32": (
        "a bfloat16 update for a float32 global model (half precision where full was sent)",
        "has dtype bfloat16, the global model has float32",
        resend({k: v.astype(ml_dtypes.bfloat16) for k, v in good_params().items()}),
    ),
    "update-header-overlapping": (
        "two tensors overlap",
        "starts at byte",
        replace_tensors(safetensors_bytes({"w": _W, "b": {**_B, "data_offsets": [8, 16]}}, _FLOATS)),
    ),
    "update-header-negative-shape": (
        "a negative dimension",
        "bad shape",
        replace_tensors(safetensors_bytes({"w": {**_W, "shape": [-4]}, "b": _B}, _FLOATS)),
    ),
    "update-header-duplicate-key": (
        "a tensor name appears twice",
        "duplicate keys",
        replace_tensors(safetensors_bytes('{"w": ' + json.dumps(_W) + ', "w": ' + json.dumps(_W) + "}", _FLOATS)),
    ),
    "update-header-trailing-bytes": (
        "bytes after the last tensor",
        "the file has",
        replace_tensors(safetensors_bytes({"w": _W, "b": _B}, _FLOATS + b"junk")),
    ),
    "record-not-json": ("the record is not JSON", "unreadable artifact record", raw_record("{nope")),
    "record-binary": ("the record is binary", "not UTF-8 text", lambda p: record_path(p).write_bytes(b"\xff\xfe\x00")),
    "record-list": ("the record is a JSON list", "the record is not a JSON object", raw_record("[1, 2]")),
    "record-deeply-nested": (
        "the record is 100 000 nested JSON arrays",
        "nested too deeply",
        raw_record(nested(100_000)),
    ),
    "record-wrong-format": ("the record names another format", "format is 'other/9'", set_record("format", "other/9")),
    "record-sha-not-hex": (
        "the record's sha256 is not a hex digest",
        "sha256 must be 64 hex digits",
        set_record("sha256", "xyz"),
    ),
    "record-size-negative": ("the record's size is negative", "size must be an integer", set_record("size", -1)),
    "record-size-huge": ("the record claims 2^60 bytes", "size must be an integer", set_record("size", 1 << 60)),
    "record-size-float": ("the record's size is a float", "size must be an integer", set_record("size", 24.5)),
    "record-params-type-unknown": (
        "params_type is neither FULL nor DIFF",
        "is not a valid ParamsType",
        set_record("params_type", "HALF"),
    ),
    "num-samples-inf": (
        "num_samples is 1e400 (infinity in JSON)",
        "num_samples must be a positive integer",
        raw_record_sub('"num_samples": 5', '"num_samples": 1e400'),
    ),
    "num-samples-huge-int": (
        "num_samples is 10**400",
        "num_samples must be a positive integer",
        raw_record_sub('"num_samples": 5', '"num_samples": 1' + "0" * 400),
    ),
    "num-samples-nan": (
        "num_samples is NaN",
        "not a number this format accepts",
        raw_record_sub('"num_samples": 5', '"num_samples": NaN'),
    ),
    "num-samples-zero": ("num_samples is 0", "num_samples must be a positive integer", set_record("num_samples", 0)),
    "num-samples-negative": (
        "num_samples is negative",
        "num_samples must be a positive integer",
        set_record("num_samples", -7),
    ),
    "num-samples-float": (
        "num_samples is 2.5",
        "num_samples must be a positive integer",
        set_record("num_samples", 2.5),
    ),
    "num-samples-bool": (
        "num_samples is true",
        "num_samples must be a positive integer",
        set_record("num_samples", True),
    ),
    "num-samples-string": (
        "num_samples is a string",
        "num_samples must be a positive integer",
        set_record("num_samples", "5"),
    ),
    "num-samples-near-float-max": (
        "num_samples is 1.7e308",
        "num_samples must be a positive integer",
        set_record("num_samples", 1.7e308),
    ),
    "metric-nan": (
        "a metric is NaN in the record",
        "not a number this format accepts",
        raw_record_sub('"metrics": {}', '"metrics": {"loss": NaN}'),
    ),
    "metric-infinity": (
        "a metric is Infinity in the record",
        "not a number this format accepts",
        raw_record_sub('"metrics": {}', '"metrics": {"loss": Infinity}'),
    ),
    "metric-overflow": (
        "a metric is 1e400",
        "metrics must be finite numbers",
        raw_record_sub('"metrics": {}', '"metrics": {"loss": 1e400}'),
    ),
    "metric-string": ("a metric is a string", "must be a number, got str", set_record("metrics", {"loss": "low"})),
    "metric-name-huge": (
        "a metric name of 2 MB in the record",
        "is 2000000 characters long; metric names are 1 to 100 printable characters",
        set_record("metrics", {"x" * 2_000_000: 1.0}),
    ),
    "metrics-too-many": (
        "1000 metrics in the record",
        "1000 metrics, more than the 64 an update may report",
        set_record("metrics", {f"m{i}": 1.0 for i in range(1000)}),
    ),
    "record-size-10-to-12": (
        "the record claims 10^12 bytes",
        "its record says 1000000000000 bytes, more than an update of the global model's tensors can take",
        set_record("size", 10**12),
    ),
    "metrics-not-object": ("metrics is a list", "metrics must be an object", set_record("metrics", [1])),
    "meta-not-object": ("meta is a string", "meta must be an object", set_record("meta", "x")),
    "record-tensors-bad": (
        "the record's tensor list is malformed",
        "expected [dtype, shape]",
        set_record("tensors", {"w": "F32"}),
    ),
    "record-huge": ("the record is 20 MiB", "more than", raw_record('{"pad": "' + "x" * (20 << 20) + '"}')),
    "update-replaced-after-acceptance": (
        "another writer replaced the update after its site task accepted it",
        "is not the update its site task accepted",
        resend(good_params(7.0)),
    ),
}


CASES = [Case(i, "update_file", what, error) for i, (what, error, _) in BAD.items()]
CASES += [
    Case(
        "aggregate-float16-diff-overflow",
        "update_file",
        "float16 DIFF updates whose sum with the global model overflows",
        "is not finite in float16 (overflow)",
    ),
    Case(
        "aggregate-int8-out-of-range",
        "update_file",
        "int8 DIFF updates whose mean leaves int8's range",
        "leaves the range of int8",
    ),
    Case(
        "update-bf16-nan",
        "update_file",
        "a bfloat16 tensor holds NaN (numpy files bf16 under kind 'V', not 'f')",
        "contains NaN or infinite values",
    ),
    Case(
        "site-weight-times-samples-overflow",
        "update_file",
        "a site weight of 1e300 times num_samples 10**15",
        "it must be finite and > 0",
    ),
]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in BAD], ids=lambda c: c.id)
def test_a_bad_update_rejects_its_site_only(case: Case, tmp_path: pathlib.Path) -> None:
    good = write(tmp_path / "site-1.safetensors", good_params(1.0))
    bad = write(tmp_path / "site-2.safetensors", good_params(3.0))
    accepted = {"site-1": read_record(good).sha256, "site-2": read_record(bad).sha256}
    BAD[case.id][2](bad)
    if case.id != "update-replaced-after-acceptance":
        # As if the site task had accepted the damaged files (its own checks are the trainer
        # battery's subject): the aggregation must still refuse them.
        with contextlib.suppress(ModelFormatError):
            accepted["site-2"] = read_record(bad).sha256
    out = fedavg_from_store(
        GLOBAL, [("site-1", good, None), ("site-2", bad, None)], min_clients=1, accepted_sha256=accepted
    )
    assert list(out.accepted) == ["site-1"], out.rejected
    assert_clear(case, out.rejected["site-2"])
    assert len(out.rejected["site-2"]) < 600, "messages stay short"
    assert all_finite(out.params) is None
    np.testing.assert_array_equal(out.params["w"], np.full(4, 1.0, np.float32))


def _overflow(case_id: str, tmp_path: pathlib.Path) -> str:
    if case_id == "aggregate-float16-diff-overflow":
        glob = {"w": np.full(3, 60000, np.float16)}
        diff = {"w": np.full(3, 60000, np.float16)}
    else:
        glob = {"w": np.full(3, 100, np.int8)}
        diff = {"w": np.full(3, 100, np.int8)}
    paths = []
    for site in ("site-1", "site-2"):
        path = tmp_path / f"{site}.safetensors"
        write_artifact(path, FLModel(params=diff, params_type=ParamsType.DIFF, meta={"num_samples": 3}))
        paths.append((site, path, None))
    with pytest.raises(AggregateNotFinite) as exc:
        fedavg_from_store(glob, paths, min_clients=1)
    return str(exc.value)


@pytest.mark.parametrize("case_id", ["aggregate-float16-diff-overflow", "aggregate-int8-out-of-range"])
def test_an_aggregate_that_overflows_fails_the_round_and_is_not_published(case_id: str, tmp_path) -> None:
    (case,) = [c for c in CASES if c.id == case_id]
    message = _overflow(case_id, tmp_path)
    assert_clear(case, message)
    assert "The global model was not updated" in message


def test_a_weight_that_overflows_rejects_the_site(tmp_path: pathlib.Path) -> None:
    (case,) = [c for c in CASES if c.id == "site-weight-times-samples-overflow"]
    good = write(tmp_path / "site-1.safetensors", good_params(1.0))
    big = write(tmp_path / "site-2.safetensors", good_params(3.0), num_samples=10**15)
    out = fedavg_from_store(
        GLOBAL,
        [("site-1", good, None), ("site-2", big, None)],
        min_clients=1,
        site_weights={"site-2": 1e300 * 1e10},
    )
    assert list(out.accepted) == ["site-1"]
    assert_clear(case, out.rejected["site-2"])


def test_writing_a_record_refuses_what_reading_would_refuse(tmp_path: pathlib.Path) -> None:
    for meta in ({"num_samples": 10**400}, {"num_samples": float("inf")}):
        with pytest.raises(ModelFormatError, match="num_samples"):
            write(tmp_path / "x.safetensors", good_params(), **meta)
    with pytest.raises(ModelFormatError, match="metrics must be finite"):
        write_artifact(tmp_path / "y.safetensors", FLModel(params=good_params(), metrics={"loss": float("nan")}))


def test_a_nan_in_a_bf16_update_rejects_its_site(tmp_path: pathlib.Path) -> None:
    case = next(c for c in CASES if c.id == "update-bf16-nan")
    bf16 = ml_dtypes.bfloat16
    glob = {"w": np.zeros(4, bf16), "b": np.zeros(2, bf16)}
    good = write(tmp_path / "site-1.safetensors", {"w": np.ones(4, bf16), "b": np.ones(2, bf16)})
    bad = write(tmp_path / "site-2.safetensors", {"w": np.array([1, np.nan, 1, 1], bf16), "b": np.ones(2, bf16)})
    outcome = fedavg_from_store(glob, [("site-1", good, None), ("site-2", bad, None)], min_clients=1)
    assert list(outcome.accepted) == ["site-1"]
    assert_clear(case, outcome.rejected["site-2"])
    assert outcome.params["w"].dtype == bf16 and outcome.params["w"].tolist() == [1, 1, 1, 1]
