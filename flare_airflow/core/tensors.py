"""The tensors file format: a strict safetensors parser and streamed, verified reads.

Strict, as safetensors itself (known dtypes, contiguous offsets covering the file, no pickle);
reads go through ``readinto`` in cache-sized pieces, hashing each piece and checking floating-point
values for NaN/inf while they are in the CPU cache. No knowledge of records or the model store.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flare_airflow.core.digests import SHA256, Hasher, new_hasher
from flare_airflow.core.errors import ModelFormatError
from flare_airflow.core.store import WritablePath, open_for_reading

try:
    import ml_dtypes
except ImportError:  # a trainer image with only numpy and safetensors: bfloat16 files are refused there
    ml_dtypes = None  # type: ignore[assignment]

Params = dict[str, np.ndarray]

# safetensors' dtype names -> numpy (little-endian, as the format stores them). BF16 (language models'
# weights and adapters) is ml_dtypes' bfloat16, a real numpy dtype: a bf16 tensor is read, hashed,
# checked for NaN/inf, validated and written back as bf16 -- never upcast behind the author's back --
# and safetensors.numpy writes it as BF16. (The alternative, raw uint16 plus a side tag, would make
# every dtype comparison, cast and finite check a special case.) ml-dtypes is a dependency of the
# package and of the `client` extra; an environment without it refuses BF16 as unsupported. The
# float8 formats stay refused: nothing here trains in them.
SAFETENSORS_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(code)
    for name, code in {
        "F64": "<f8", "F32": "<f4", "F16": "<f2", "C64": "<c8",
        "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
        "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
    }.items()
}  # fmt: skip
BFLOAT16: np.dtype[Any] | None = None if ml_dtypes is None else np.dtype(ml_dtypes.bfloat16)
if BFLOAT16 is not None:
    SAFETENSORS_DTYPES["BF16"] = BFLOAT16


def is_float(dtype: np.dtype[Any]) -> bool:
    """A real floating-point dtype: numpy's (kind ``f``) or bfloat16 (whose numpy kind is ``V``, so a
    ``kind == "f"`` test would let a bf16 tensor skip every finite check, clip and noise)."""
    return dtype.kind == "f" or (BFLOAT16 is not None and dtype == BFLOAT16)


def is_inexact(dtype: np.dtype[Any]) -> bool:
    """Floating-point or complex: the dtypes whose values can be NaN or infinite."""
    return dtype.kind == "c" or is_float(dtype)


MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
CHUNK_BYTES = 1 << 20  # reading + hashing and the finite check go through a file in cache-sized pieces


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
                hint = " (install ml-dtypes to read bfloat16)" if info["dtype"] == "BF16" else ""
                raise ValueError(f"tensor {name!r}: unsupported dtype {info['dtype']!r}{hint}")
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


def parse_safetensors(data: Any, where: str, layout: list[TensorSlice] | None = None) -> Params:
    """Tensors of a safetensors buffer as zero-copy arrays over it (read-only if ``data`` is ``bytes``).

    ``layout``: the buffer's :func:`safetensors_layout`, when already parsed from these same bytes
    (:attr:`FiniteScan.layout`); parsed here otherwise.
    """
    tensors = safetensors_layout(data, where) if layout is None else layout
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

    @property
    def layout(self) -> list[TensorSlice] | None:
        """The strict layout of the header it scanned (None: not read yet, or invalid), for
        :func:`parse_safetensors` to reuse instead of parsing the same header again."""
        return self._tensors or None

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
            if is_inexact(t.dtype):
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


def _open_file_size(fh: Any) -> int | None:
    """The size of the open file ``fh`` as its file system or object store reports it, or ``None``."""
    try:
        return os.fstat(fh.fileno()).st_size
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    size = getattr(fh, "size", None)  # fsspec's buffered files (s3://, gs://, memory://, ...)
    return size if type(size) is int else None


def _size_mismatch(path: WritablePath, got: int, size: int) -> ModelFormatError:
    if got < size:
        return ModelFormatError(
            f"{path}: size {got} bytes, record says {size}; the file is truncated or its record is wrong"
        )
    return ModelFormatError(f"{path}: larger than the {size} bytes its record says; the file was changed")


def read_into(
    path: WritablePath,
    size: int,
    buffer: np.ndarray | Callable[[int], np.ndarray] | None = None,
    scan: FiniteScan | None = None,
    algorithms: tuple[str, ...] = (SHA256,),
) -> tuple[Any, dict[str, str]]:
    """The file's bytes, which must be exactly ``size`` (its record's), and their digests.

    ``size`` comes from a record, which is input: the file's real size is compared with it before
    anything of that size is allocated, so a record claiming 10^12 bytes is refused, not a
    ``MemoryError``. Reads ``CHUNK_BYTES`` at a time with ``readinto`` straight into
    ``buffer[:size]`` (a reused buffer; a callable is asked for one of at least ``size`` bytes once
    the file's size matched) or a new one, hashing each piece with every one of
    ``algorithms`` while it is still in the CPU cache (and feeding it to ``scan``). A file object
    that reports no size, or has no ``readinto`` (some object-store backends), is read piece by
    piece into new ``bytes``, never more than ``size + 1`` bytes. The hashing and the finite checks
    release the GIL.
    """
    hashers: list[Hasher] = [new_hasher(a) for a in algorithms]
    with open_for_reading(path) as fh:
        actual = _open_file_size(fh)
        if actual is not None and actual != size:
            raise _size_mismatch(path, actual, size)
        if actual is None or not hasattr(fh, "readinto"):  # read(n) may allocate n bytes up front
            pieces: list[bytes] = []
            got = 0
            while got <= size and (piece := fh.read(min(CHUNK_BYTES, size + 1 - got))):
                pieces.append(piece)
                got += len(piece)
                for h in hashers:
                    h.update(piece)
            data: Any = b"".join(pieces)
            del pieces
            if scan is not None and got == size:
                scan.feed(data, got)
        else:
            if callable(buffer):
                buffer = buffer(size)
            # np.empty, not bytearray: a bytearray is zero-filled first, one more pass over fresh memory.
            target: Any = buffer if buffer is not None and buffer.nbytes >= size else np.empty(size, dtype=np.uint8)
            data = memoryview(target)[:size]
            got = 0
            while got < size:
                k = fh.readinto(data[got : got + CHUNK_BYTES])
                if not k:
                    break
                for h in hashers:
                    h.update(data[got : got + k])
                got += k
                if scan is not None:
                    scan.feed(data, got)
            if got == size and fh.read(1):
                got += 1
    if got != size:
        raise _size_mismatch(path, got, size)
    return data, {a: h.hexdigest() for a, h in zip(algorithms, hashers, strict=True)}


def all_finite(params: Params) -> str | None:
    """Return the name of the first tensor with a NaN or infinity, or ``None``.

    Checks ``CHUNK_BYTES`` at a time: no array-sized temporary, each piece in the CPU cache.
    """
    for name, arr in params.items():
        if is_inexact(arr.dtype):
            flat = arr.reshape(-1)
            step = max(1, CHUNK_BYTES // arr.dtype.itemsize)
            if not all(np.isfinite(flat[s : s + step]).all() for s in range(0, flat.size, step)):
                return name
    return None
