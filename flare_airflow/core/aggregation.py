"""Aggregation strategies. FedAvg: streaming, float64 accumulation, every update validated first.

Memory does not grow with the number of sites: the accumulator has the size of the global model (in
float64), and :func:`fedavg_from_store` holds at most two updates, in two reused buffers.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import numpy as np

from flare_airflow.core.accumulate import ACC_CHUNK, accumulate
from flare_airflow.core.digests import BLAKE3, SHA256, available
from flare_airflow.core.errors import (
    AggregateNotFinite,
    FlareAirflowError,
    ModelFormatError,
    QuorumNotReached,
    UpdateRejected,
)
from flare_airflow.core.model import (
    MAX_HEADER,
    MAX_METRICS,
    ArtifactRecord,
    FiniteScan,
    Params,
    ParamsType,
    all_finite,
    check_num_samples,
    read_record,
    read_verified,
    tensor_spec,
)
from flare_airflow.core.store import WritablePath
from flare_airflow.core.tensors import is_inexact

# fedavg_from_store verifies this many updates side by side (two threads, each update in its own
# read buffer), then adds them to the accumulator in one pass: peak memory is the float64
# accumulator + this many updates, and the accumulator is loaded from memory once per group instead
# of per update. Measured at 1 MiB x 256: groups of 4-16 small updates cost more CPU than they save
# (each buffer is fresh memory, whose first touch costs more than the hand-overs between threads).
_GROUP = 2
_THREADS = 2
_PARALLEL_ELEMENTS = 1 << 20  # from this much multiply-add work (elements x updates) the pass is split over the threads


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


@dataclass
class RoundOutcome:
    """What a round produced: the new global model and who counted."""

    params: Params
    accepted: dict[str, float]  # site -> effective weight
    rejected: dict[str, str]  # site -> reason
    metrics: dict[str, float]  # sample-weighted mean of the sites' metrics
    site_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    num_samples: int = 0
    metrics_dropped: list[str] = field(default_factory=list)  # means left out: more than MAX_METRICS names
    selected: list[str] | None = None  # the sites a selecting rule (Krum) combined; None: every accepted site
    clipped: dict[str, float] = field(default_factory=dict)  # site -> factor its update was scaled by (norm bound)


class PieceStep(Protocol):
    """A step after the mean, fed a piece of it at a time while it is in the CPU cache (a server
    optimizer: :class:`flare_airflow.core.strategies.server_optimizers.StepPieces`)."""

    def touches(self, name: str) -> bool:
        """Whether the step changes tensor ``name`` (others keep the mean)."""
        ...

    def piece(self, name: str, s: int, e: int, aggregate: np.ndarray) -> np.ndarray:
        """The new elements [s, e) of tensor ``name`` (float64) from the mean's, cast to the tensor's dtype."""
        ...


class FedAvg:
    """Federated averaging weighted by ``num_samples`` x an optional per-site weight.

    FULL updates contribute ``w * params``; DIFF updates contribute ``w * (global + diff)``. The
    result is cast back to each tensor's dtype (integers rounded).
    """

    def __init__(
        self,
        global_params: Params,
        *,
        min_clients: int,
        site_weights: Mapping[str, float] | None = None,
    ) -> None:
        if min_clients < 1:
            raise FlareAirflowError(f"min_clients must be >= 1, got {min_clients}")
        self.global_params = global_params
        # The global model's tensor_spec: what every update must match (validate_update).
        self.expected = tensor_spec(global_params)
        self.min_clients = min_clients
        self.site_weights = dict(site_weights or {})
        self._acc = {k: np.zeros(v.shape, dtype=np.float64) for k, v in global_params.items()}
        self._scratches = [np.empty(ACC_CHUNK, dtype=np.float64)]  # free ones; one per running thread
        self._scratch_lock = threading.Lock()
        self._diff_weight = 0.0
        self._total_weight = 0.0
        self._metric_sums: dict[str, float] = {}
        self._metric_weights: dict[str, float] = {}
        self.accepted: dict[str, float] = {}
        self.rejected: dict[str, str] = {}
        self.site_metrics: dict[str, dict[str, float]] = {}
        self.num_samples = 0
        self._consumed = False  # result() writes the new global model over the accumulators
        self._outcome: RoundOutcome | None = None

    def reject(self, site: str, reason: str) -> None:
        self.rejected[site] = reason

    def add(self, site: str, params: Params, record: ArtifactRecord) -> None:
        """Validate and accumulate one update; on a bad update the site is recorded as rejected."""
        try:
            validate_update(site, self.expected, params)
        except UpdateRejected as exc:
            self.add_checked(site, params, record, rejected=exc)
            return
        self.add_checked(site, params, record)

    def add_checked(
        self, site: str, params: Params, record: ArtifactRecord, *, rejected: UpdateRejected | None = None
    ) -> None:
        """Accumulate an update already checked by :func:`validate_update` (or reject it with ``rejected``)."""
        self.add_verified([(site, params, record, rejected)])

    def add_verified(
        self,
        group: Sequence[tuple[str, Params, ArtifactRecord, UpdateRejected | None]],
        run: Callable[[Sequence[Callable[[], None]]], object] | None = None,
    ) -> None:
        """Count a group of updates already checked by :func:`validate_update`, in the group's order.

        Each item is ``(site, params, record, rejected)``; a site with ``rejected`` set, or whose
        record gives no usable weight, is recorded as rejected. The accepted ones are added to the
        accumulator in one pass (:func:`accumulate`); ``run``, when given, runs a list of callables
        side by side (threads) and the pass is split over them by element ranges -- the sums are
        bitwise the same as one update at a time.
        """
        sites = [site for site, *_ in group]
        for site in sites:
            if site in self.accepted or site in self.rejected or sites.count(site) > 1:
                raise FlareAirflowError(f"site {site!r} already counted in this round")
            if self._consumed:
                raise FlareAirflowError(f"site {site!r} arrived after the round's result was computed")
        counted: list[tuple[Params, np.float64]] = []
        for site, params, record, rejected in group:
            samples = record.num_samples if record.num_samples is not None else 1
            if rejected is None:
                weight, rejected = update_weight(site, record, self.site_weights)
            if rejected is not None:
                self.rejected[site] = rejected.reason
                continue
            counted.append((params, np.float64(weight)))
            if record.params_type is ParamsType.DIFF:
                self._diff_weight += weight
            self._total_weight += weight
            self.accepted[site] = weight
            self.num_samples += samples
            self.site_metrics[site] = dict(record.metrics)
            for key, value in record.metrics.items():
                self._metric_sums[key] = self._metric_sums.get(key, 0.0) + value * samples
                self._metric_weights[key] = self._metric_weights.get(key, 0.0) + samples
        if not counted:
            return
        # More parts than threads: whichever thread is on a core takes the next part.
        work = sum(a.size for a in self._acc.values()) * len(counted)
        parts = 2 * _THREADS if run is not None and work >= _PARALLEL_ELEMENTS else 1
        if parts == 1 or run is None:
            accumulate(self._acc, counted, self._scratches[0])
        else:
            run([partial(self._accumulate_part, counted, (i, parts)) for i in range(parts)])

    def _accumulate_part(self, counted: Sequence[tuple[Params, np.float64]], part: tuple[int, int]) -> None:
        """One element range of the accumulation pass, with a scratch no other thread is using."""
        with self._scratch_lock:
            scratch = self._scratches.pop() if self._scratches else np.empty(ACC_CHUNK, dtype=np.float64)
        try:
            accumulate(self._acc, counted, scratch, part)
        finally:
            with self._scratch_lock:
                self._scratches.append(scratch)

    def _not_finite(self, name: str, why: str) -> AggregateNotFinite:
        return AggregateNotFinite(
            f"the aggregate of sites {sorted(self.accepted)} is unusable: tensor {name!r}: {why}. "
            "The global model was not updated; check the sites' updates and weights (num_samples, weight)."
        )

    def result(self, step: PieceStep | None = None) -> RoundOutcome:
        """The new global model; raises ``QuorumNotReached`` with every failed site's reason.

        ``step``: a step after the mean, applied in the same pass, each piece of the mean cast to the
        tensor's dtype first (as the step would see the whole mean) -- the model is bitwise what the
        step gives applied to the whole mean, without reading the mean from memory again.
        """
        if len(self.accepted) < self.min_clients:
            raise below_quorum(sorted(self.accepted), self.min_clients, self.rejected)
        if self._outcome is not None:
            return self._outcome
        if self._consumed:
            raise FlareAirflowError("this round's result failed already; its accumulators are spent")
        out: Params = {}
        if not (math.isfinite(self._total_weight) and self._total_weight > 0):
            raise AggregateNotFinite(
                f"the sum of the sites' weights is {self._total_weight}; the global model was not updated"
            )
        diff_weight, total = np.float64(self._diff_weight), np.float64(self._total_weight)
        mean, base = self._scratches[0], np.empty_like(self._scratches[0])
        self._consumed = True  # from here on the accumulators hold (part of) the result
        for name, ref in self.global_params.items():
            # (acc + global * diff_weight) / total, rounded for integers, cast back: piece by piece,
            # so no float64 temporary of the model's size (the same roundings as whole arrays).
            # The result is written over the accumulator's own memory (no dtype is wider than its
            # float64): element i lands in bytes [i*k, (i+1)*k) with k <= 8, which only hold
            # accumulator elements <= i, already read into ``mean``. No new model-sized allocation
            # (on these VMs first-touching fresh memory costs more than the arithmetic), at the price
            # of the result's arrays keeping the accumulator's memory (2x a float32 model) alive.
            acc, glob = self._acc[name].reshape(-1), ref.reshape(-1)
            flat = acc.view(np.uint8)[: acc.size * ref.dtype.itemsize].view(ref.dtype)
            res = flat.reshape(ref.shape)
            for s in range(0, acc.size, ACC_CHUNK):
                e = min(s + ACC_CHUNK, acc.size)
                m = mean[: e - s]
                if diff_weight:
                    np.multiply(glob[s:e], diff_weight, out=base[: e - s])
                    np.add(acc[s:e], base[: e - s], out=m)
                    np.divide(m, total, out=m)
                else:
                    np.divide(acc[s:e], total, out=m)
                if ref.dtype.kind in "iu":
                    np.rint(m, out=m)
                    info = np.iinfo(ref.dtype)
                    if m.size and (m.min() < info.min or m.max() > info.max):
                        raise self._not_finite(name, f"its mean leaves the range of {ref.dtype}")
                with np.errstate(over="ignore", invalid="ignore"):  # checked just below
                    flat[s:e] = m
                if is_inexact(ref.dtype) and not np.isfinite(flat[s:e]).all():
                    # float64 sums of finite updates are finite; the cast back (float16, float32) or a
                    # DIFF added to the global model can still overflow.
                    raise self._not_finite(name, f"its mean is not finite in {ref.dtype} (overflow)")
                if step is not None and step.touches(name):
                    stepped = step.piece(name, s, e, flat[s:e])
                    with np.errstate(over="ignore", invalid="ignore"):  # checked just below
                        flat[s:e] = stepped
                    if not np.isfinite(flat[s:e]).all():
                        raise self._not_finite(name, f"the server optimizer's step is not finite in {ref.dtype}")
            out[name] = res
        metrics, dropped = round_metrics(self._metric_sums, self._metric_weights)
        self._outcome = RoundOutcome(
            params=out,
            accepted=dict(self.accepted),
            rejected=dict(self.rejected),
            metrics=metrics,
            site_metrics=dict(self.site_metrics),
            num_samples=self.num_samples,
            metrics_dropped=dropped,
        )
        return self._outcome


def failed_sites(rejected: Mapping[str, str]) -> str:
    """Every rejected site with its reason, for a round's failure message."""
    return "; ".join(f"{s}: {r}" for s, r in sorted(rejected.items())) or "none reported"


def below_quorum(valid: Sequence[str], min_clients: int, rejected: Mapping[str, str]) -> QuorumNotReached:
    """The one message of a round with fewer valid updates than ``min_clients``, whatever the rule."""
    return QuorumNotReached(
        f"{len(valid)} valid update(s) from {list(valid)}, min_clients is {min_clients}. "
        f"Failed sites: {failed_sites(rejected)}. The global model was not updated."
    )


def round_metrics(sums: Mapping[str, float], weights: Mapping[str, float]) -> tuple[dict[str, float], list[str]]:
    """The round's sample-weighted metric means, and the names left out of them.

    Each site's metrics are finite, but their sample-weighted sum may not be: such a mean is left out.
    Each site sends at most ``MAX_METRICS``, but sites may name different ones: the round (one
    artifact record, one XCom) keeps the ones reported for the most samples.
    """
    metrics = {k: sums[k] / weights[k] for k in sorted(sums)}
    metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
    dropped: list[str] = []
    if len(metrics) > MAX_METRICS:
        kept = sorted(metrics, key=lambda k: (-weights[k], k))[:MAX_METRICS]
        dropped = sorted(set(metrics) - set(kept))
        metrics = {k: metrics[k] for k in sorted(kept)}
    return metrics, dropped


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
    :mod:`flare_airflow.core.strategies.engine`): ``slots`` buffers, one per update read side by side.
    """

    def __init__(
        self,
        expected: Mapping[str, tuple[str, tuple[int, ...]]],
        accepted_sha256: Mapping[str, str] | None,
        accepted_blake3: Mapping[str, str] | None,
        slots: int = _GROUP,
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
    with ThreadPoolExecutor(max_workers=_THREADS - 1, thread_name_prefix="fedavg") as pool:

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


def fedavg_from_store(
    global_params: Params,
    updates: Iterable[tuple[str, WritablePath | None, str | None]],
    *,
    min_clients: int,
    site_weights: Mapping[str, float] | None = None,
    accepted_sha256: Mapping[str, str] | None = None,
    accepted_blake3: Mapping[str, str] | None = None,
) -> RoundOutcome:
    """Stream updates from the store into FedAvg, at most two in memory at a time.

    ``updates`` yields ``(site, path, failure)``; a site whose job failed passes ``path=None`` and
    the reason. Unreadable or invalid updates make their site rejected for the round.
    ``accepted_sha256`` (site -> sha256), when given, is what each site task accepted: an update
    whose record names another checksum was replaced after that (a late or foreign writer) and
    does not count. ``accepted_blake3`` (site -> BLAKE3, from the same site tasks) pins the
    record's BLAKE3 digest the same way.

    Each file is checked against one digest of its record: BLAKE3 when the record has one, the
    package is installed and the digest is pinned (by ``accepted_blake3``, or nothing is pinned:
    ``accepted_sha256`` is not given), else sha256. The site task verified both digests before it
    published them, so a file matching the pinned BLAKE3 is the file whose sha256 it published.

    Updates go in groups of two, in site order. The two of a group are verified side by side, one
    per thread, each into its own reused buffer: read it, verify its size and digest against its
    record (hashing, and checking floating-point tensors for NaN/inf, piece by piece as it is read),
    parse the safetensors header into zero-copy tensors and check names, shapes and dtypes. Only
    then does the group count: in site order, each update is accepted or its site rejected, and the
    accepted ones are added to the accumulator in one pass, split by element ranges over the two
    threads (the float64 sums are bitwise the same as one update at a time, whatever the number of
    threads). hashlib, blake3 and numpy release the GIL, so both cores work in both phases.
    """
    agg = FedAvg(global_params, min_clients=min_clients, site_weights=site_weights)
    return stream_from_store(agg, updates, accepted_sha256=accepted_sha256, accepted_blake3=accepted_blake3)


def stream_from_store(
    agg: FedAvg,
    updates: Iterable[tuple[str, WritablePath | None, str | None]],
    *,
    accepted_sha256: Mapping[str, str] | None = None,
    accepted_blake3: Mapping[str, str] | None = None,
    step: PieceStep | None = None,
) -> RoundOutcome:
    """The streaming half of the store engine: :func:`fedavg_from_store`'s reads and groups, into any
    accumulator with FedAvg's interface (``expected``, ``reject``, ``add_verified``, ``result``);
    ``step`` goes to FedAvg's :meth:`FedAvg.result`."""
    reader = UpdateReader(agg.expected, accepted_sha256, accepted_blake3)
    ordered = sorted(updates, key=lambda u: u[0])
    with side_by_side_runner() as side_by_side:
        for start in range(0, len(ordered), _GROUP):
            group = side_by_side(
                [partial(reader.read, slot, *update) for slot, update in enumerate(ordered[start : start + _GROUP])]
            )
            for site, _, record, reason in group:
                if record is None:
                    agg.reject(site, reason or "no update")
            agg.add_verified(
                [
                    (site, params, record, UpdateRejected(site, reason) if reason else None)
                    for site, params, record, reason in group
                    if record is not None
                ],
                side_by_side,
            )
            del group
    reader.release()  # before the result is computed: peak memory is the larger of the two phases
    return agg.result(step) if step is not None else agg.result()
