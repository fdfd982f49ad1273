"""The FL model exchanged between the global model and the sites, and its on-disk format.

An artifact is two files: ``NAME.safetensors`` (the tensors; never pickle) and ``NAME.json`` (its
record: sha256 and, where the ``blake3`` package is installed, BLAKE3 digests, size, params type,
sample count, metrics). The record is written last, so an
artifact without a record is incomplete and is never read.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import safetensors.numpy

from flare_airflow.core.digests import BLAKE3, HEX_DIGEST, SHA256, available, new_hasher, verifiable
from flare_airflow.core.errors import ModelFormatError
from flare_airflow.core.store import MAX_RECORD_BYTES, WritablePath, open_for_reading, read_at_most, record_path
from flare_airflow.core.tensors import (
    CHUNK_BYTES,
    MAX_HEADER,
    SAFETENSORS_DTYPES,
    FiniteScan,
    Params,
    TensorSlice,
    all_finite,
    parse_safetensors,
    read_into,
    safetensors_layout,
    tensor_view,
)

# Re-exported: the model's format is read through this module.
__all__ = [
    "CHUNK_BYTES",
    "FORMAT",
    "MAX_HEADER",
    "MAX_METRICS",
    "MAX_METRIC_NAME",
    "SAFETENSORS_DTYPES",
    "ArtifactRecord",
    "FLModel",
    "FiniteScan",
    "Params",
    "ParamsType",
    "TensorSlice",
    "WritablePath",
    "all_finite",
    "atomic_write",
    "check_metrics",
    "check_num_samples",
    "parse_safetensors",
    "read_artifact",
    "read_into",
    "read_record",
    "read_verified",
    "record_path",
    "safetensors_layout",
    "tensor_spec",
    "tensor_view",
    "write_artifact",
]

FORMAT = "flare-airflow/1"


class ParamsType(enum.StrEnum):
    """What ``params`` holds: the full weights, or the difference to the global model received."""

    FULL = "FULL"
    DIFF = "DIFF"


@dataclass
class FLModel:
    """A model as the Client API sends and receives it (NVFlare's ``FLModel`` shape).

    Parameters
    ----------
    params:
        Named numpy arrays. Empty for an evaluation result.
    params_type:
        ``FULL`` weights or a ``DIFF`` to the global model that was received.
    metrics:
        Scalar metrics (``{"loss": 0.3}``); non-numeric values are rejected on send.
    meta:
        Free-form small metadata; ``num_samples`` is the FedAvg weight.
    current_round, total_rounds, site:
        Filled in by ``receive()``.
    """

    params: Params = field(default_factory=dict)
    params_type: ParamsType = ParamsType.FULL
    metrics: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    current_round: int | None = None
    total_rounds: int | None = None
    site: str | None = None


@dataclass(frozen=True)
class ArtifactRecord:
    """The record kept next to a tensors file."""

    sha256: str
    size: int
    params_type: ParamsType
    num_samples: int | None
    metrics: dict[str, float]
    meta: dict[str, Any]
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    # BLAKE3 digest of the same bytes; absent in records written without the blake3 package (and
    # in all records before it was added): those are verified by sha256 alone.
    blake3: str | None = None

    def digests(self) -> dict[str, str]:
        """Algorithm -> hex digest of every digest this record holds (sha256 always)."""
        return {SHA256: self.sha256, **({BLAKE3: self.blake3} if self.blake3 else {})}

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "sha256": self.sha256,
                **({"blake3": self.blake3} if self.blake3 else {}),
                "size": self.size,
                "params_type": self.params_type.value,
                "num_samples": self.num_samples,
                "metrics": self.metrics,
                "meta": self.meta,
                "tensors": {k: [d, list(s)] for k, (d, s) in self.tensors.items()},
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> ArtifactRecord:
        """Parse a record strictly: every field typed and in range, nothing non-finite.

        A record is written by a site (or a trainer that bypassed the Client API), so it is input:
        a bad one raises ``ModelFormatError`` and rejects that site, never the round.
        """
        if len(text) > MAX_RECORD_BYTES:
            raise ModelFormatError(
                f"{where}: artifact record is more than {MAX_RECORD_BYTES} bytes (a record lists tensor names, "
                "shapes and a few metrics)"
            )
        try:
            raw = json.loads(text, parse_constant=_no_constant)
            if not isinstance(raw, dict):
                raise ValueError("the record is not a JSON object")
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {_short(raw.get('format'))}, expected {FORMAT!r}")
            sha256, size, tensors = raw.get("sha256"), raw.get("size"), raw.get("tensors")
            if not isinstance(sha256, str) or not HEX_DIGEST.match(sha256):
                raise ValueError(f"sha256 must be 64 hex digits, got {_short(sha256)}")
            blake3 = raw.get("blake3")
            if blake3 is not None and (not isinstance(blake3, str) or not HEX_DIGEST.match(blake3)):
                raise ValueError(f"blake3 must be 64 hex digits, got {_short(blake3)}")
            if type(size) is not int or not 0 <= size <= MAX_ARTIFACT_BYTES:
                raise ValueError(f"size must be an integer from 0 to {MAX_ARTIFACT_BYTES}, got {_short(size)}")
            if not isinstance(tensors, dict):
                raise ValueError(f"tensors must be an object, got {_short(tensors)}")
            meta = raw.get("meta", {})
            if not isinstance(meta, dict):
                raise ValueError(f"meta must be an object, got {_short(meta)}")
            metrics = raw.get("metrics", {})
            if not isinstance(metrics, dict):
                raise ValueError(f"metrics must be an object, got {_short(metrics)}")
            return cls(
                sha256=sha256,
                size=size,
                params_type=ParamsType(str(raw.get("params_type"))),
                num_samples=check_num_samples(raw.get("num_samples")),
                metrics=check_metrics(metrics, where),
                meta=meta,
                tensors={str(k): _tensor_entry(k, v) for k, v in tensors.items()},
                blake3=blake3,
            )
        except ModelFormatError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, RecursionError, OverflowError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ModelFormatError(f"{where}: unreadable artifact record ({reason[:200]})") from None


MAX_ARTIFACT_BYTES = 1 << 50
MAX_NUM_SAMPLES = 10**15  # so that sums of weights stay exact and finite in float64


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number this format accepts (JSON has no NaN or infinity)")


def _tensor_entry(name: Any, value: Any) -> tuple[str, tuple[int, ...]]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not isinstance(value[0], str)
        or not isinstance(value[1], list)
    ):
        raise ValueError(f"tensor {_short(name)}: expected [dtype, shape], got {_short(value)}")
    if not all(type(x) is int and 0 <= x <= MAX_ARTIFACT_BYTES for x in value[1]):
        raise ValueError(f"tensor {_short(name)}: shape {_short(value[1])} is not a list of sizes")
    return value[0], tuple(value[1])


def check_num_samples(value: Any, what: str = "num_samples") -> int | None:
    """``num_samples`` (the FedAvg weight): absent, or an integer from 1 to ``MAX_NUM_SAMPLES``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= value <= MAX_NUM_SAMPLES:
        raise ModelFormatError(
            f"{what} must be a positive integer (the number of training samples, at most "
            f"{MAX_NUM_SAMPLES:.0e}), got {_short(value)}"
        )
    return int(value)


TensorSpec = dict[str, tuple[str, tuple[int, ...]]]


def tensor_spec(params: Params) -> TensorSpec:
    """Name -> (dtype, shape) of each tensor: what an update must match (also kept in every record)."""
    return {name: (str(arr.dtype), tuple(arr.shape)) for name, arr in params.items()}


def atomic_write(path: WritablePath, data: Any) -> None:
    """Write ``data`` (bytes-like, or an iterable of bytes-like pieces written in order) to a temporary
    sibling, then rename over the target: readers never see half a file.

    Object stores (s3://, gs://, memory://, ...) cannot rename, but there one upload is already
    all-or-nothing, so the object is written directly.
    """
    pieces = (data,) if isinstance(data, bytes | bytearray | memoryview) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    if getattr(path, "protocol", "file") not in ("file", "local", ""):
        with path.open("wb") as fh:
            for piece in pieces:
                fh.write(piece)
        return
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with tmp.open("wb") as fh:
            for piece in pieces:
                fh.write(piece)
            if hasattr(fh, "fileno"):
                try:
                    fh.flush()
                    os.fsync(fh.fileno())
                except (OSError, ValueError):
                    pass
        tmp.replace(path)
    except BaseException:
        # A full or read-only store: leave no half-written temporary behind.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def safetensors_header(params: Params, metadata: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """The header ``safetensors.numpy.save(params, metadata=metadata)`` writes (length, JSON, padding)
    and the tensors' order in its data, without serialising the data.

    safetensors itself is asked for the order and the dtype names (it sorts by dtype, then name), on
    empty stand-ins of the same dtypes: its rule stays the one rule, and the file stays byte for byte
    what it writes (a test compares the two). Raises what ``safetensors.numpy.save`` raises.
    """
    probe = safetensors.numpy.save({k: np.empty((0,), v.dtype) for k, v in params.items()}, metadata=dict(metadata))
    length = int.from_bytes(probe[:8], "little")
    layout = json.loads(probe[8 : 8 + length])
    order = [k for k in layout if k != "__metadata__"]
    header: dict[str, Any] = {"__metadata__": layout["__metadata__"]} if "__metadata__" in layout else {}
    at = 0
    for name in order:
        arr = params[name]
        header[name] = {"dtype": layout[name]["dtype"], "shape": list(arr.shape), "data_offsets": [at, at + arr.nbytes]}
        at += arr.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to a multiple of 8 bytes
    return len(text).to_bytes(8, "little") + text, order


# What one update (or evaluation) may report. Metrics travel in XCom (the site task's summary, the
# round's summary, which holds every site's), in metrics.json and in the runs page's charts: a few
# scalars each, never a payload. 64 names of at most 100 characters keep one site's metrics under
# 8 KiB of JSON.
MAX_METRICS = 64
MAX_METRIC_NAME = 100
_METRIC_NAME = re.compile(rf"[^\x00-\x1f\x7f]{{1,{MAX_METRIC_NAME}}}")


def check_metrics(metrics: Mapping[str, Any], where: str) -> dict[str, float]:
    """Metrics are at most ``MAX_METRICS`` finite numbers named by printable strings of 1 to
    ``MAX_METRIC_NAME`` characters: anything else is refused, naming the metric. A NaN or infinite
    metric cannot be carried by JSON, XCom and the charts, and would poison the round's averages."""
    if len(metrics) > MAX_METRICS:
        raise ModelFormatError(
            f"{where}: {len(metrics)} metrics, more than the {MAX_METRICS} an update may report "
            f"(first names: {_short(list(metrics)[:3])}); send a few scalars, keep the rest in your own logs"
        )
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not _METRIC_NAME.fullmatch(key):
            why = "has control characters"
            if not isinstance(key, str):
                why = f"is a {type(key).__name__}"
            elif not 0 < len(key) <= MAX_METRIC_NAME:
                why = f"is {len(key)} characters long"
            raise ModelFormatError(
                f"{where}: metric name {_short(key)} {why}; metric names are 1 to {MAX_METRIC_NAME} printable "
                "characters"
            )
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
            raise ModelFormatError(f"{where}: metric {_short(key)} must be a number, got {type(value).__name__}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ModelFormatError(
                f"{where}: metric {_short(key)} is {_short(value)}; metrics must be finite numbers "
                "(leave a metric out when it has no value)"
            )
        out[key] = number
    return out


def write_artifact(path: WritablePath, model: FLModel, *, where: str = "") -> ArtifactRecord:
    """Write ``model`` as a safetensors file plus its record, both atomically (record last)."""
    where = where or str(path)
    params: Params = {}
    for name, value in model.params.items():
        arr = np.asarray(value)
        if arr.dtype == object:
            raise ModelFormatError(f"{where}: tensor {name!r} has dtype object; only numeric arrays are stored")
        if arr.dtype.byteorder == ">":  # stored little-endian, as safetensors does
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        # Not np.ascontiguousarray: it turns 0-d tensors (e.g. a step counter) into shape (1,).
        params[name] = arr if arr.flags.c_contiguous else np.copy(arr, order="C")
    metadata = {"params_type": model.params_type.value}
    try:
        header, order = safetensors_header(params, metadata)
    except Exception as exc:  # safetensors raises its own error types for bad dtypes
        raise ModelFormatError(f"{where}: cannot serialise tensors as safetensors: {exc}") from exc
    num_samples = check_num_samples(model.meta.get("num_samples"), f"{where}: meta['num_samples']")
    meta = {k: v for k, v in model.meta.items() if k != "num_samples"}
    try:
        json.dumps(meta)
    except TypeError as exc:
        raise ModelFormatError(f"{where}: meta must be JSON-serialisable: {exc}") from exc
    metrics = check_metrics(model.metrics, where)  # before anything is written over the path
    # The file is written piece by piece from the arrays' own memory, each piece hashed on its way
    # out while it is in the CPU cache: no serialised copy of the model (on these VMs, touching that
    # much fresh memory cost more than hashing and writing it; measured in bench_strategies).
    hashers = [new_hasher(a) for a in available()]

    def pieces() -> Iterator[Any]:
        yield header
        for name in order:
            flat = params[name].reshape(-1).view(np.uint8)
            for s in range(0, flat.size, CHUNK_BYTES):
                piece = memoryview(flat[s : s + CHUNK_BYTES])  # type: ignore[arg-type]  # ndarray is a buffer
                for h in hashers:
                    h.update(piece)
                yield piece

    for h in hashers:
        h.update(header)
    atomic_write(path, pieces())
    digests = {a: h.hexdigest() for a, h in zip(available(), hashers, strict=True)}
    record = ArtifactRecord(
        sha256=digests[SHA256],
        blake3=digests.get(BLAKE3),
        size=len(header) + sum(params[name].nbytes for name in order),
        params_type=model.params_type,
        num_samples=num_samples,
        metrics=metrics,
        meta=meta,
        tensors=tensor_spec(params),
    )
    atomic_write(record_path(path), record.to_json().encode())
    return record


def read_record(path: WritablePath) -> ArtifactRecord:
    rec = record_path(path)
    try:
        # Opened without asking exists() first (one call less per record; each is slow on object stores).
        with open_for_reading(rec) as fh:
            text = read_at_most(fh, MAX_RECORD_BYTES).decode()
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: no artifact record {rec.name} (the artifact was never completed)") from None
    except UnicodeDecodeError:
        raise ModelFormatError(f"{rec}: unreadable artifact record (not UTF-8 text)") from None
    except OSError as exc:
        raise ModelFormatError(f"{rec}: cannot read the artifact record ({exc.strerror or exc})") from None
    return ArtifactRecord.from_json(text, str(rec))


def read_verified(
    path: WritablePath,
    record: ArtifactRecord,
    buffer: np.ndarray | Callable[[int], np.ndarray] | None = None,
    scan: FiniteScan | None = None,
    algorithms: tuple[str, ...] | None = None,
) -> Params:
    """Read a tensors file, check its size and digests against its record, then parse it.

    ``algorithms`` defaults to every digest of the record this environment can compute (sha256
    always, BLAKE3 too where recorded and installed); a caller may ask for fewer, never for one the
    record lacks. The tensors are zero-copy arrays over one buffer holding the file (``buffer`` if
    given; see :func:`read_into`).
    """
    recorded = record.digests()
    algorithms = verifiable(recorded) if algorithms is None else algorithms
    missing = [a for a in algorithms if a not in recorded]
    if not algorithms or missing:
        raise ModelFormatError(f"{path}: its record has no {missing or 'digest'} to verify the file against")
    data, got = read_into(path, record.size, buffer, scan, algorithms)
    for algorithm in algorithms:
        if got[algorithm] != recorded[algorithm]:
            raise ModelFormatError(
                f"{path}: {algorithm} {got[algorithm][:12]}… does not match its record {recorded[algorithm][:12]}…"
            )
    # The scan parsed the header of these very bytes already (strictly): reuse its layout.
    return parse_safetensors(data, str(path), scan.layout if scan is not None else None)


def read_artifact(path: WritablePath) -> tuple[Params, ArtifactRecord]:
    """Read an artifact, verifying size and digests (sha256, and BLAKE3 where recorded) before parsing;
    refuses anything but safetensors."""
    record = read_record(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: tensors file is missing although its record exists")
    return read_verified(path, record), record
