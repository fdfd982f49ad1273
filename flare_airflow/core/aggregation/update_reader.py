"""Reading site updates from the store, each verified before it counts, for every rule.

What an update must be to count (the global model's names, shapes and dtypes; finite values; a
usable aggregation weight; the digests its site task accepted), and :class:`UpdateReader`, which
reads and verifies updates into reused buffers, two side by side (:func:`side_by_side_runner`):
streaming FedAvg (:mod:`.aggregation`) and the chunked rules (:mod:`.strategies.engine`) both read
through it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import numpy as np

from flare_airflow.core.digests import BLAKE3, SHA256, available
from flare_airflow.core.errors import FlareAirflowError, ModelFormatError, UpdateRejected
from flare_airflow.core.model import (
    MAX_HEADER,
    ArtifactRecord,
    FiniteScan,
    Params,
    all_finite,
    check_num_samples,
    read_record,
    read_verified,
)
from flare_airflow.core.store import WritablePath

# Updates are verified this many side by side (two threads, each update in its own read buffer),
# then added to the accumulator in one pass: peak memory is the float64 accumulator + this many
# updates, and the accumulator is loaded from memory once per group instead of per update. Measured
# at 1 MiB x 256: groups of 4-16 small updates cost more CPU than they save (each buffer is fresh
# memory, whose first touch costs more than the hand-overs between threads).
GROUP = 2
THREADS = 2


def check_spec(site: str, expected: Mapping[str, tuple[str, tuple[int, ...]]], params: Params) -> None:
    """Raise ``UpdateRejected`` unless ``params`` has the global model's names, shapes and dtypes."""
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise UpdateRejected(site, f"tensor names differ from the global model (missing {missing}, unexpected {extra})")
    for name, (dtype, shape) in expected.items():
        arr = params[name]
        if arr.shape != shape:
            raise UpdateRejected(site, f"tensor {name!r} has shape {arr.shape}, the global model has {shape}")
        if str(arr.dtype) != dtype:
            raise UpdateRejected(site, f"tensor {name!r} has dtype {arr.dtype}, the global model has {dtype}")


def non_finite(site: str, name: str) -> UpdateRejected:
    return UpdateRejected(site, f"tensor {name!r} contains NaN or infinite values")


def validate_update(site: str, expected: Mapping[str, tuple[str, tuple[int, ...]]], params: Params) -> None:
    """Raise ``UpdateRejected`` unless ``params`` matches the global model's names, shapes, dtypes
    and holds no NaN or infinity.

    ``expected`` is the global model's :func:`tensor_spec` -- from its arrays or, without reading
    them, from its record (``read_record(path).tensors``).
    """
    check_spec(site, expected, params)
    bad = all_finite(params)
    if bad is not None:
        raise non_finite(site, bad)


def update_weight(
    site: str, record: ArtifactRecord, site_weights: Mapping[str, float]
) -> tuple[float, UpdateRejected | None]:
    """The update's aggregation weight, ``num_samples`` (1 when absent) x the site's weight, or why it has none."""
    samples = record.num_samples if record.num_samples is not None else 1
    try:
        check_num_samples(record.num_samples)
        weight = float(samples) * float(site_weights.get(site, 1.0))
    except (ModelFormatError, OverflowError, TypeError, ValueError) as exc:
        return 0.0, UpdateRejected(site, f"unusable aggregation weight: {exc}")
    if not (math.isfinite(weight) and weight > 0):
        return weight, UpdateRejected(
            site, f"aggregation weight is {weight} (num_samples x site weight); it must be finite and > 0"
        )
    return weight, None


def _pinned_digest(
    site: str,
    path: WritablePath,
    record: ArtifactRecord,
    accepted_sha256: Mapping[str, str] | None,
    accepted_blake3: Mapping[str, str] | None,
) -> str:
    """Check the record's digests against what the site task accepted; return the one to verify the file by."""
    for algorithm, accepted, recorded in (
        (SHA256, accepted_sha256, record.sha256),
        (BLAKE3, accepted_blake3, record.blake3),
    ):
        expected = None if accepted is None else accepted.get(site)
        if accepted is not None and (expected is not None or algorithm == SHA256) and recorded != expected:
            raise ModelFormatError(
                f"{path}: {algorithm} {(recorded or 'none')[:12]}… is not the update its site task accepted "
                f"({(expected or 'none')[:12]}…): the file was replaced after the task checked it"
            )
    blake3_pinned = accepted_sha256 is None or (accepted_blake3 is not None and site in accepted_blake3)
    return BLAKE3 if record.blake3 and blake3_pinned and BLAKE3 in available() else SHA256


_T = TypeVar("_T")
_Verified = tuple[str, Params, ArtifactRecord | None, str | None]  # site, tensors, record, why rejected


class UpdateReader:
    """Reads site updates from the store, each verified before it counts, into reused buffers.

    One reader serves every aggregation rule (:func:`fedavg_from_store` and the chunked rules of
    :mod:`flare_airflow.core.aggregation.engine`): ``slots`` buffers, one per update read side by side.
    """

    def __init__(
        self,
        expected: Mapping[str, tuple[str, tuple[int, ...]]],
        accepted_sha256: Mapping[str, str] | None,
        accepted_blake3: Mapping[str, str] | None,
        slots: int = GROUP,
    ) -> None:
        self.expected = expected
        self.accepted_sha256 = accepted_sha256
        self.accepted_blake3 = accepted_blake3
        # No update of the global model's tensors is larger: a record claiming more is refused before
        # a buffer of that size is allocated.
        self.max_size = (
            8 + MAX_HEADER + sum(math.prod(shape) * np.dtype(dtype).itemsize for dtype, shape in expected.values())
        )
        self.buffers = [np.empty(0, dtype=np.uint8) for _ in range(slots)]

    def _grown(self, slot: int, size: int) -> np.ndarray:
        if self.buffers[slot].nbytes < size:
            self.buffers[slot] = np.empty(0, dtype=np.uint8)  # the old one goes before the new one comes
            self.buffers[slot] = np.empty(size, dtype=np.uint8)
        return self.buffers[slot]

    def read(self, slot: int, site: str, path: WritablePath | None, failure: str | None) -> _Verified:
        """The update's tensors (views into buffer ``slot``) and record, or why it does not count."""
        if path is None:
            return site, {}, None, failure or "no update"
        record = None
        try:
            record = read_record(path)
            algorithm = _pinned_digest(site, path, record, self.accepted_sha256, self.accepted_blake3)
            if record.size > self.max_size:
                raise ModelFormatError(
                    f"{path}: its record says {record.size} bytes, more than an update of the global model's "
                    f"tensors can take ({self.max_size})"
                )
            scan = FiniteScan()  # NaN/inf are looked for piece by piece as the file is read and hashed
            # The buffer grows only once the file's real size matched its record's.
            params = read_verified(path, record, partial(self._grown, slot), scan, (algorithm,))
            check_spec(site, self.expected, params)
            if scan.bad is not None:
                raise non_finite(site, scan.bad)
        except UpdateRejected as exc:
            return site, {}, record, exc.reason
        except FlareAirflowError as exc:
            return site, {}, record, str(exc)
        except OSError as exc:  # the site's file vanished or cannot be read: that site does not count
            return site, {}, record, f"{path}: cannot read the update ({exc.strerror or type(exc).__name__})"
        return site, params, record, None

    def release(self) -> None:
        """Free the read buffers (before a result is computed: peak memory is the larger of the two phases)."""
        self.buffers = [np.empty(0, dtype=np.uint8) for _ in self.buffers]


@contextmanager
def side_by_side_runner() -> Iterator[Callable[[Sequence[Callable[[], Any]]], list[Any]]]:
    """A function running a list of calls on this thread and one pool thread, side by side."""
    with ThreadPoolExecutor(max_workers=THREADS - 1, thread_name_prefix="fedavg") as pool:

        def side_by_side(calls: Sequence[Callable[[], _T]]) -> list[_T]:
            """Run ``calls`` on this thread and the pool's one thread, whichever is free taking the next
            call, and return their results in order; raise the first call's error once all have
            stopped (they use the read buffers).

            One hand-over to the pool's thread per list, not per call; on a loaded machine a thread
            waiting for a core holds up nothing: this thread takes every call that thread has not
            started. Which thread runs a call changes nothing in its result.
            """
            pending = deque(enumerate(calls))
            results: list[_T | None] = [None] * len(calls)
            errors: list[tuple[int, BaseException]] = []

            def drain() -> None:
                while True:
                    try:
                        i, call = pending.popleft()  # atomic: each call is taken by one thread
                    except IndexError:
                        return
                    try:
                        results[i] = call()
                    except BaseException as exc:
                        errors.append((i, exc))

            helper = pool.submit(drain) if len(calls) > 1 else None
            drain()
            if helper is not None and not helper.cancel():
                helper.result()
            if errors:
                raise min(errors, key=lambda e: e[0])[1]
            return results  # type: ignore[return-value]  # every call returned

        yield side_by_side
