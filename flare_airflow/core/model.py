"""The FL model exchanged between the global model and the sites, and its on-disk format.

An artifact is two files: ``NAME.safetensors`` (the tensors; never pickle) and ``NAME.json`` (its
record: sha256, size, params type, sample count, metrics). The record is written last, so an
artifact without a record is incomplete and is never read.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import math
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import safetensors.numpy

from flare_airflow.core.errors import ModelFormatError
from flare_airflow.core.store import WritablePath, record_path

FORMAT = "flare-airflow/1"


class ParamsType(enum.StrEnum):
    """What ``params`` holds: the full weights, or the difference to the global model received."""

    FULL = "FULL"
    DIFF = "DIFF"


Params = dict[str, np.ndarray]


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

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "sha256": self.sha256,
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
            raise ModelFormatError(f"{where}: artifact record is {len(text)} bytes, more than {MAX_RECORD_BYTES}")
        try:
            raw = json.loads(text, parse_constant=_no_constant)
            if not isinstance(raw, dict):
                raise ValueError("the record is not a JSON object")
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {_short(raw.get('format'))}, expected {FORMAT!r}")
            sha256, size, tensors = raw.get("sha256"), raw.get("size"), raw.get("tensors")
            if not isinstance(sha256, str) or not _SHA256.match(sha256):
                raise ValueError(f"sha256 must be 64 hex digits, got {_short(sha256)}")
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
            )
        except ModelFormatError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, RecursionError, OverflowError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ModelFormatError(f"{where}: unreadable artifact record ({reason[:200]})") from None


MAX_RECORD_BYTES = 16 << 20  # a record lists names, shapes and a few metrics: far below this
MAX_ARTIFACT_BYTES = 1 << 50
MAX_NUM_SAMPLES = 10**15  # so that sums of weights stay exact and finite in float64
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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


def atomic_write(path: WritablePath, data: bytes) -> None:
    """Write to a temporary sibling, then rename over the target: readers never see half a file.

    Object stores (s3://, gs://, memory://, ...) cannot rename, but there one upload is already
    all-or-nothing, so the object is written directly.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if getattr(path, "protocol", "file") not in ("file", "local", ""):
        with path.open("wb") as fh:
            fh.write(data)
        return
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
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


def check_metrics(metrics: Mapping[str, Any], where: str) -> dict[str, float]:
    """Metrics are finite numbers: a NaN or infinite metric is refused (JSON, XCom and the charts
    cannot carry it, and it would poison the round's averages)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
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
        out[str(key)] = number
    return out


def write_artifact(path: WritablePath, model: FLModel, *, where: str = "") -> ArtifactRecord:
    """Write ``model`` as a safetensors file plus its record, both atomically (record last)."""
    where = where or str(path)
    params: Params = {}
    for name, value in model.params.items():
        arr = np.asarray(value)
        if arr.dtype == object:
            raise ModelFormatError(f"{where}: tensor {name!r} has dtype object; only numeric arrays are stored")
        # Not np.ascontiguousarray: it turns 0-d tensors (e.g. a step counter) into shape (1,).
        params[name] = arr if arr.flags.c_contiguous else np.copy(arr, order="C")
    metadata = {"params_type": model.params_type.value}
    try:
        data = safetensors.numpy.save(params, metadata=metadata)
    except Exception as exc:  # safetensors raises its own error types for bad dtypes
        raise ModelFormatError(f"{where}: cannot serialise tensors as safetensors: {exc}") from exc
    num_samples = check_num_samples(model.meta.get("num_samples"), f"{where}: meta['num_samples']")
    meta = {k: v for k, v in model.meta.items() if k != "num_samples"}
    try:
        json.dumps(meta)
    except TypeError as exc:
        raise ModelFormatError(f"{where}: meta must be JSON-serialisable: {exc}") from exc
    record = ArtifactRecord(
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        params_type=model.params_type,
        num_samples=num_samples,
        metrics=check_metrics(model.metrics, where),
        meta=meta,
        tensors=tensor_spec(params),
    )
    atomic_write(path, data)
    atomic_write(record_path(path), record.to_json().encode())
    return record


def read_record(path: WritablePath) -> ArtifactRecord:
    rec = record_path(path)
    if not rec.exists():
        raise ModelFormatError(f"{path}: no artifact record {rec.name} (the artifact was never completed)")
    try:
        # In pieces: read(n) would allocate n bytes up front, and records are small.
        pieces, size = [], 0
        with rec.open("rb") as fh:
            while size <= MAX_RECORD_BYTES and (piece := fh.read(1 << 16)):
                pieces.append(piece)
                size += len(piece)
        text = b"".join(pieces).decode()
    except UnicodeDecodeError:
        raise ModelFormatError(f"{rec}: unreadable artifact record (not UTF-8 text)") from None
    except OSError as exc:
        raise ModelFormatError(f"{rec}: cannot read the artifact record ({exc.strerror or exc})") from None
    return ArtifactRecord.from_json(text, str(rec))


# safetensors' dtype names -> numpy (little-endian, as the format stores them); BF16 and the float8
# formats have no numpy dtype and are refused, as safetensors.numpy refuses them.
SAFETENSORS_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(code)
    for name, code in {
        "F64": "<f8", "F32": "<f4", "F16": "<f2", "C64": "<c8",
        "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
        "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
    }.items()
}  # fmt: skip
MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
CHUNK_BYTES = 1 << 18  # reading + hashing and the finite check go through a file in cache-sized pieces


@dataclass(frozen=True)
class TensorSlice:
    """Where one tensor lies in a safetensors buffer (absolute byte offsets)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    start: int
    end: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys in the header")
    return out


def safetensors_layout(data: Any, where: str) -> list[TensorSlice]:
    """Parse and check a safetensors header; return its tensors in file order.

    Strict, as safetensors itself: a JSON object of known dtypes, integer shapes and offsets; the
    tensors' byte ranges are contiguous, each exactly ``prod(shape) x itemsize`` long, and together
    cover the buffer to its last byte. Raises ``ModelFormatError`` (naming pickle payloads as such).
    """
    view = memoryview(data).cast("B")
    try:
        if len(view) < 8:
            raise ValueError(f"{len(view)} bytes, shorter than the 8-byte header length")
        hlen = int.from_bytes(view[:8], "little")
        if hlen > MAX_HEADER or 8 + hlen > len(view):
            raise ValueError(f"header length {hlen} does not fit a {len(view)}-byte file")
        header = json.loads(bytes(view[8 : 8 + hlen]).decode("utf-8"), object_pairs_hook=_no_duplicates)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        base = 8 + hlen
        tensors = []
        for name, info in header.items():
            if name == "__metadata__":
                if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                    raise ValueError("__metadata__ must map strings to strings")
                continue
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise ValueError(f"tensor {name!r}: expected dtype, shape and data_offsets, got {info!r}")
            dtype = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
            if dtype is None:
                raise ValueError(f"tensor {name!r}: unsupported dtype {info['dtype']!r}")
            shape, offsets = info["shape"], info["data_offsets"]
            ints = [*shape, *offsets] if isinstance(shape, list) and isinstance(offsets, list) else [None]
            if len(offsets) != 2 or not all(type(x) is int and x >= 0 for x in ints):
                raise ValueError(f"tensor {name!r}: bad shape {shape!r} or data_offsets {offsets!r}")
            if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {name!r}: data_offsets {offsets} do not hold {shape} x {info['dtype']}")
            tensors.append(TensorSlice(name, dtype, tuple(shape), base + offsets[0], base + offsets[1]))
        tensors.sort(key=lambda t: (t.start, t.end))
        at = base
        for t in tensors:
            if t.start != at:
                raise ValueError(f"tensor {t.name!r} starts at byte {t.start - base} of the data, expected {at - base}")
            at = t.end
        if at != len(view):
            raise ValueError(f"the tensors end at byte {at}, the file has {len(view)}")
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError, OverflowError) as exc:
        if isinstance(exc, RecursionError):
            raise ModelFormatError(f"{where}: not a valid safetensors file (its header is nested too deeply)") from None
        if view[:1] == b"\x80" or view[:2] == b"PK":
            raise ModelFormatError(
                f"{where}: this is a pickle/torch.save payload; only safetensors files are accepted "
                "(write updates with the Client API's send() or safetensors.numpy.save_file)"
            ) from exc
        raise ModelFormatError(f"{where}: not a valid safetensors file ({exc})") from exc
    return tensors


def tensor_view(data: Any, t: TensorSlice) -> np.ndarray:
    """A zero-copy array over the tensor's bytes (numpy handles an unaligned start correctly)."""
    return np.frombuffer(data, dtype=t.dtype, count=math.prod(t.shape), offset=t.start).reshape(t.shape)


def parse_safetensors(data: Any, where: str) -> Params:
    """Tensors of a safetensors buffer as zero-copy arrays over it (read-only if ``data`` is ``bytes``)."""
    tensors = safetensors_layout(data, where)
    return {t.name: tensor_view(data, t) for t in sorted(tensors, key=lambda t: t.name)}


class FiniteScan:
    """Finds NaN/inf in a safetensors file's floating-point tensors while its bytes arrive.

    :func:`read_into` calls ``feed(data, upto)`` after each piece: once the header is in, every
    float element wholly inside ``data[:upto]`` and not yet checked is checked -- right after the
    piece was hashed, while it is in the CPU cache. ``bad`` is then the first tensor (in file
    order) holding NaN or infinity, or ``None``. Meaningful only once the bytes' sha256 matched;
    an invalid header stops the scan (parsing reports it).
    """

    def __init__(self) -> None:
        self.bad: str | None = None
        self._tensors: list[TensorSlice] | None = None
        self._next = 0  # the tensor being checked
        self._done = 0  # absolute offset checked up to in it

    def feed(self, data: Any, upto: int) -> None:
        if self._tensors is None:
            if upto < 8 or upto < 8 + int.from_bytes(data[:8], "little"):
                return
            try:
                self._tensors = safetensors_layout(data, "")
            except ModelFormatError:
                self._tensors = []
        while self.bad is None and self._next < len(self._tensors):
            t = self._tensors[self._next]
            if t.dtype.kind in "fc":
                start = max(self._done, t.start)
                end = t.start + (min(upto, t.end) - t.start) // t.dtype.itemsize * t.dtype.itemsize
                if end > start:
                    count = (end - start) // t.dtype.itemsize
                    if not np.isfinite(np.frombuffer(data, dtype=t.dtype, count=count, offset=start)).all():
                        self.bad = t.name
                    self._done = end
                if end < t.end:
                    return
            self._next += 1


def read_into(
    path: WritablePath, size: int, buffer: np.ndarray | None = None, scan: FiniteScan | None = None
) -> tuple[Any, str]:
    """The file's bytes, which must be exactly ``size`` (its record's), and their sha256.

    Reads ``CHUNK_BYTES`` at a time with ``readinto`` straight into ``buffer[:size]`` (a reused
    buffer) or a new one, hashing each piece while it is still in the CPU cache (and feeding it to
    ``scan``). A file object without ``readinto`` (some object-store backends) is read with
    ``read()`` into new ``bytes``. The hashing and the finite checks release the GIL.
    """
    hasher = hashlib.sha256()
    with path.open("rb") as fh:
        if not hasattr(fh, "readinto"):
            data: Any = fh.read(size + 1)
            got = len(data)
            hasher.update(data)
            if scan is not None and got == size:
                scan.feed(data, got)
        else:
            target: Any = buffer if buffer is not None and buffer.nbytes >= size else bytearray(size)
            data = memoryview(target)[:size]
            got = 0
            while got < size:
                k = fh.readinto(data[got : got + CHUNK_BYTES])
                if not k:
                    break
                hasher.update(data[got : got + k])
                got += k
                if scan is not None:
                    scan.feed(data, got)
            if got == size and fh.read(1):
                got += 1
    if got < size:
        raise ModelFormatError(f"{path}: size {got} bytes, record says {size}; the file is truncated")
    if got > size:
        raise ModelFormatError(f"{path}: larger than the {size} bytes its record says; the file was changed")
    return data, hasher.hexdigest()


def read_verified(
    path: WritablePath, record: ArtifactRecord, buffer: np.ndarray | None = None, scan: FiniteScan | None = None
) -> Params:
    """Read a tensors file, check its size and sha256 against its record, then parse it.

    The tensors are zero-copy arrays over one buffer holding the file (``buffer`` if given).
    """
    data, digest = read_into(path, record.size, buffer, scan)
    if digest != record.sha256:
        raise ModelFormatError(f"{path}: sha256 {digest[:12]}… does not match its record {record.sha256[:12]}…")
    return parse_safetensors(data, str(path))


def read_artifact(path: WritablePath) -> tuple[Params, ArtifactRecord]:
    """Read an artifact, verifying size and sha256 before parsing; refuses anything but safetensors."""
    record = read_record(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: tensors file is missing although its record exists")
    return read_verified(path, record), record


def all_finite(params: Params) -> str | None:
    """Return the name of the first tensor with a NaN or infinity, or ``None``.

    Checks ``CHUNK_BYTES`` at a time: no array-sized temporary, each piece in the CPU cache.
    """
    for name, arr in params.items():
        if arr.dtype.kind in "fc":
            flat = arr.reshape(-1)
            step = max(1, CHUNK_BYTES // arr.dtype.itemsize)
            if not all(np.isfinite(flat[s : s + step]).all() for s in range(0, flat.size, step)):
                return name
    return None
