"""The FL model exchanged between the global model and the sites, and its on-disk format.

An artifact is two files: ``NAME.safetensors`` (the tensors; never pickle) and ``NAME.json`` (its
record: sha256, size, params type, sample count, metrics). The record is written last, so an
artifact without a record is incomplete and is never read.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import safetensors.numpy

from flare_airflow.core.errors import ModelFormatError

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


class WritablePath(Protocol):
    """What the store needs of a path: ``pathlib.Path``, ``UPath`` or Airflow's ``ObjectStoragePath``."""

    def __truediv__(self, other: str) -> WritablePath: ...

    def open(self, mode: str = ...) -> Any: ...

    def exists(self) -> bool: ...

    def unlink(self, missing_ok: bool = ...) -> None: ...

    def mkdir(self, parents: bool = ..., exist_ok: bool = ...) -> None: ...

    @property
    def parent(self) -> Any: ...

    @property
    def name(self) -> str: ...


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
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT!r}")
            return cls(
                sha256=str(raw["sha256"]),
                size=int(raw["size"]),
                params_type=ParamsType(raw["params_type"]),
                num_samples=None if raw.get("num_samples") is None else int(raw["num_samples"]),
                metrics={str(k): float(v) for k, v in raw.get("metrics", {}).items()},
                meta=dict(raw.get("meta", {})),
                tensors={k: (str(v[0]), tuple(int(x) for x in v[1])) for k, v in raw["tensors"].items()},
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ModelFormatError(f"{where}: unreadable artifact record ({exc})") from exc


TensorSpec = dict[str, tuple[str, tuple[int, ...]]]


def tensor_spec(params: Params) -> TensorSpec:
    """Name -> (dtype, shape) of each tensor: what an update must match (also kept in every record)."""
    return {name: (str(arr.dtype), tuple(arr.shape)) for name, arr in params.items()}


def record_path(tensors_path: WritablePath) -> WritablePath:
    return tensors_path.parent / (tensors_path.name.removesuffix(".safetensors") + ".json")


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
    with tmp.open("wb") as fh:
        fh.write(data)
        if hasattr(fh, "fileno"):
            try:
                fh.flush()
                os.fsync(fh.fileno())
            except (OSError, ValueError):
                pass
    tmp.replace(path)


def check_metrics(metrics: dict[str, Any], where: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
            raise ModelFormatError(f"{where}: metric {key!r} must be a number, got {type(value).__name__}")
        out[str(key)] = float(value)
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
    num_samples = model.meta.get("num_samples")
    if num_samples is not None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer) or num_samples <= 0:
            raise ModelFormatError(f"{where}: meta['num_samples'] must be a positive integer, got {num_samples!r}")
        num_samples = int(num_samples)
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
    with rec.open("rb") as fh:
        return ArtifactRecord.from_json(fh.read().decode(), str(rec))


def read_artifact(path: WritablePath) -> tuple[Params, ArtifactRecord]:
    """Read an artifact, verifying size and sha256 before parsing; refuses anything but safetensors."""
    record = read_record(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: tensors file is missing although its record exists")
    with path.open("rb") as fh:
        data = fh.read()
    if len(data) != record.size:
        raise ModelFormatError(f"{path}: size {len(data)} bytes, record says {record.size}; the file is truncated")
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.sha256:
        raise ModelFormatError(f"{path}: sha256 {digest[:12]}… does not match its record {record.sha256[:12]}…")
    return parse_safetensors(data, str(path)), record


def parse_safetensors(data: bytes, where: str) -> Params:
    try:
        return dict(safetensors.numpy.load(data))
    except Exception as exc:
        if data[:1] == b"\x80" or data[:2] == b"PK":
            raise ModelFormatError(
                f"{where}: this is a pickle/torch.save payload; only safetensors files are accepted "
                "(write updates with the Client API's send() or safetensors.numpy.save_file)"
            ) from exc
        raise ModelFormatError(f"{where}: not a valid safetensors file ({exc})") from exc


def all_finite(params: Params) -> str | None:
    """Return the name of the first tensor with a NaN or infinity, or ``None``."""
    for name, arr in params.items():
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            return name
    return None


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
