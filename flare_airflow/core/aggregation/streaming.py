"""Streaming FedAvg: float64 accumulation, every update verified first (:mod:`.update_reader`).

Memory does not grow with the number of sites: the accumulator has the size of the global model (in
float64), and :func:`fedavg_from_store` holds at most two updates, in two reused buffers.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Protocol

import numpy as np

from flare_airflow.core.aggregation.accumulate import ACC_CHUNK, accumulate
from flare_airflow.core.aggregation.tally import RoundOutcome, RoundTally
from flare_airflow.core.aggregation.update_reader import (
    GROUP,
    THREADS,
    UpdateReader,
    side_by_side_runner,
    update_weight,
    validate_update,
)
from flare_airflow.core.errors import (
    AggregateNotFinite,
    FlareAirflowError,
    UpdateRejected,
)
from flare_airflow.core.model import (
    ArtifactRecord,
    Params,
    ParamsType,
    tensor_spec,
)
from flare_airflow.core.store import WritablePath
from flare_airflow.core.tensors import is_inexact

_PARALLEL_ELEMENTS = 1 << 20  # from this much multiply-add work (elements x updates) the pass is split over the threads


class PieceStep(Protocol):
    """A step after the mean, fed a piece of it at a time while it is in the CPU cache (a server
    optimizer: :class:`flare_airflow.core.aggregation.strategies.server_optimizers.StepPieces`)."""

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
        self.tally = RoundTally()
        self._consumed = False  # result() writes the new global model over the accumulators
        self._outcome: RoundOutcome | None = None

    @property
    def accepted(self) -> dict[str, float]:
        """The sites counted so far, with their effective weights."""
        return self.tally.accepted

    def reject(self, site: str, reason: str) -> None:
        self.tally.reject(site, reason)

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
            self.tally.check_new(site)
            if sites.count(site) > 1:
                raise FlareAirflowError(f"site {site!r} already counted in this round")
            if self._consumed:
                raise FlareAirflowError(f"site {site!r} arrived after the round's result was computed")
        counted: list[tuple[Params, np.float64]] = []
        for site, params, record, rejected in group:
            if rejected is None:
                weight, rejected = update_weight(site, record, self.site_weights)
            if rejected is not None:
                self.tally.reject(site, rejected.reason)
                continue
            counted.append((params, np.float64(weight)))
            if record.params_type is ParamsType.DIFF:
                self._diff_weight += weight
            self._total_weight += weight
            self.tally.accept(site, record, weight)
        if not counted:
            return
        # More parts than threads: whichever thread is on a core takes the next part.
        work = sum(a.size for a in self._acc.values()) * len(counted)
        parts = 2 * THREADS if run is not None and work >= _PARALLEL_ELEMENTS else 1
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
        self.tally.check_quorum(self.min_clients)
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
        self._outcome = self.tally.outcome(out)
        return self._outcome


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
        for start in range(0, len(ordered), GROUP):
            group = side_by_side(
                [partial(reader.read, slot, *update) for slot, update in enumerate(ordered[start : start + GROUP])]
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
