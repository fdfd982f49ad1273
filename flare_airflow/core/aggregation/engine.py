"""The store engine: a round's updates from the model store into any strategy, verified first.

- A streaming rule without norm bounding gets the updates one verified buffer at a time
  (:func:`flare_airflow.core.aggregation.streaming.stream_from_store`, FedAvg's engine, bitwise unchanged).
- Otherwise the engine works in two phases. Phase 1 verifies every update exactly as FedAvg's
  engine does (size, digest against its record and the site task's pin, NaN/inf, names, shapes,
  dtypes; two updates side by side in reused buffers) and notes where each tensor lies in the file
  and, with a norm bound, the update's norm. Phase 2 reads the verified files again a coordinate
  chunk at a time into one float64 ``(updates, chunk)`` stack, which the rule combines (a rule
  that ``observes`` -- Krum -- first sees every chunk once). Peak memory: two updates in phase 1;
  the stack (``CHUNK_BYTES``) plus the output model in phase 2 -- never sites x model.
  A site whose update was republished between the phases (its record names another digest
  afterwards) makes the round fail: nothing is written, and running the task again aggregates the
  files as they now are.

Then each post-aggregation step (server optimizer, ...) runs on the rule's aggregate with its state
from the previous round -- a server optimizer right after streaming FedAvg inside FedAvg's result
pass, a piece of the mean at a time; the caller stores the new state next to the round's global model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from flare_airflow.core.aggregation.strategies.base import (
    ChunkRule,
    PostStep,
    StepContext,
    Strategy,
    StreamingRule,
    cast_back,
)
from flare_airflow.core.aggregation.strategies.norm_bound import clip_factor, update_norm
from flare_airflow.core.aggregation.strategies.server_optimizers import ServerOptimizer
from flare_airflow.core.aggregation.streaming import FedAvg, stream_from_store
from flare_airflow.core.aggregation.tally import RoundOutcome, RoundTally
from flare_airflow.core.aggregation.update_reader import GROUP, UpdateReader, side_by_side_runner, update_weight
from flare_airflow.core.errors import FlareAirflowError, ModelFormatError, QuorumNotReached
from flare_airflow.core.model import ArtifactRecord, Params, ParamsType, read_record, tensor_spec
from flare_airflow.core.store import WritablePath, open_for_reading

CHUNK_BYTES = (
    8 << 20
)  # the float64 stack of one chunk of every update: cache-sized (measured: np.median 2x faster than at 64 MiB)
MIN_CHUNK = 4096  # elements: fewer would make the reads too small to be efficient

Update = tuple[str, WritablePath | None, str | None]  # site, path (None: no update), why not


@dataclass
class _Counted:
    """A verified update, as phase 2 needs it."""

    site: str
    path: WritablePath
    record: ArtifactRecord
    weight: float
    offsets: dict[str, int]  # tensor -> byte offset of its data in the file
    scale: float  # norm bounding's factor (1: within the bound)


def aggregate_from_store(
    strategy: Strategy,
    global_params: Params,
    updates: Iterable[Update],
    *,
    min_clients: int,
    site_weights: Mapping[str, float] | None = None,
    accepted_sha256: Mapping[str, str] | None = None,
    accepted_blake3: Mapping[str, str] | None = None,
    state: Params | None = None,
    context: StepContext | None = None,
    consume_state: bool = False,
) -> tuple[RoundOutcome, Params]:
    """The round's outcome and the strategy's new server state (empty without post-aggregation steps).

    ``updates``, ``accepted_sha256`` and ``accepted_blake3`` as for
    :func:`flare_airflow.core.aggregation.streaming.fedavg_from_store`; ``state`` is the previous round's
    server state (empty in round 1); with ``consume_state`` the caller hands its arrays over (e.g.
    just read from the store) and the new state is written over them -- no model-sized allocation.
    A server optimizer after FedAvg runs inside FedAvg's result pass (one pass over the mean, the
    same bytes as after it). Raises ``QuorumNotReached`` when fewer than ``min_clients``
    valid updates arrived or the rule's own minimum is not met.
    """
    if min_clients < 1:
        raise FlareAirflowError(f"min_clients must be >= 1, got {min_clients}")
    weights = dict(site_weights or {})
    rule = strategy.rule
    steps = strategy.steps
    new_state: Params = {}

    def state_of(step: PostStep) -> Params:
        prefix = f"{step.name}/"
        return {k[len(prefix) :]: v for k, v in (state or {}).items() if k.startswith(prefix)}

    if strategy.streams() and isinstance(rule, StreamingRule):
        agg = rule.start(global_params, min_clients=min_clients, site_weights=weights)
        fused = None
        if steps and isinstance(steps[0], ServerOptimizer) and isinstance(agg, FedAvg):
            fused = steps[0].pieces(global_params, state_of(steps[0]), in_place=consume_state)
        outcome = stream_from_store(
            agg,  # type: ignore[arg-type]
            updates,
            accepted_sha256=accepted_sha256,
            accepted_blake3=accepted_blake3,
            step=fused,
        )
        if fused is not None:
            new_state.update({f"{steps[0].name}/{k}": v for k, v in fused.state().items()})
            steps = steps[1:]
        problem = strategy.quorum_problem(len(outcome.accepted))
        if problem is not None:
            raise QuorumNotReached(f"{problem}. The global model was not updated.")
    else:
        outcome = chunked_from_store(
            rule,  # type: ignore[arg-type]  # every rule has the chunked form
            global_params,
            updates,
            min_clients=min_clients,
            site_weights=weights,
            accepted_sha256=accepted_sha256,
            accepted_blake3=accepted_blake3,
            norm_bound=strategy.norm_bound,
        )
    if steps:
        context = context or StepContext(job="", run_id="", round=0)
        params = outcome.params
        for step in steps:
            params, step_state = step.apply(global_params, params, state_of(step), context)
            new_state.update({f"{step.name}/{k}": v for k, v in step_state.items()})
        outcome.params = params
    return outcome, new_state


def chunk_elements(rows: int) -> int:
    """Elements per chunk so that the float64 stack of ``rows`` updates stays within ``CHUNK_BYTES``."""
    return max(MIN_CHUNK, CHUNK_BYTES // (8 * max(rows, 1)))


def _read_exact(fh: Any, offset: int, out: memoryview) -> None:
    fh.seek(offset)
    got = 0
    while got < len(out):
        n = fh.readinto(out[got:])
        if not n:
            raise ModelFormatError(f"unexpected end of file at byte {offset + got}")
        got += n


def chunked_from_store(
    rule: ChunkRule,
    global_params: Params,
    updates: Iterable[Update],
    *,
    min_clients: int,
    site_weights: Mapping[str, float],
    accepted_sha256: Mapping[str, str] | None = None,
    accepted_blake3: Mapping[str, str] | None = None,
    norm_bound: float | None = None,
) -> RoundOutcome:
    """Phase 1 (verify every update) and phase 2 (combine chunk by chunk); see the module docstring."""
    expected = tensor_spec(global_params)
    reader = UpdateReader(expected, accepted_sha256, accepted_blake3)
    tally = RoundTally()
    counted: list[_Counted] = []

    def inspect(slot: int, site: str, path: WritablePath | None, failure: str | None) -> tuple[Any, ...]:
        """Verify one update; note its tensors' offsets and (with a norm bound) its norm."""
        site, params, record, reason = reader.read(slot, site, path, failure)
        if reason is not None or record is None:
            return site, path, record, reason, {}, 1.0
        base = reader.buffers[slot].ctypes.data
        offsets = {name: arr.ctypes.data - base for name, arr in params.items()}
        scale = 1.0
        if norm_bound is not None:
            scale = clip_factor(update_norm(params, global_params, record.params_type is ParamsType.DIFF), norm_bound)
        return site, path, record, None, offsets, scale

    ordered = sorted(updates, key=lambda u: u[0])
    with side_by_side_runner() as side_by_side:
        for start in range(0, len(ordered), GROUP):
            group = side_by_side(
                [partial(inspect, slot, *update) for slot, update in enumerate(ordered[start : start + GROUP])]
            )
            for site, path, record, reason, offsets, scale in group:
                tally.check_new(site)
                if reason is not None or record is None:
                    tally.reject(site, reason or "no update")
                    continue
                weight, rejected = update_weight(site, record, site_weights)
                if rejected is not None:
                    tally.reject(site, rejected.reason)
                    continue
                tally.accept(site, record, weight)
                counted.append(_Counted(site, path, record, weight, offsets, scale))
    reader.release()

    sites = [c.site for c in counted]
    tally.check_quorum(min_clients)
    problem = rule.quorum_problem(len(counted))
    if problem is not None:
        raise QuorumNotReached(
            f"{problem}; valid updates from {sites}. Failed sites: {tally.failed()}. The global model was not updated."
        )

    weights = np.array([c.weight for c in counted], dtype=np.float64)
    chunk = chunk_elements(len(counted))
    stack = np.empty((len(counted), chunk), dtype=np.float64)
    out: Params = {}
    with contextlib.ExitStack() as files:
        handles = [files.enter_context(open_for_reading(c.path)) for c in counted]
        raw = bytearray(chunk * max((np.dtype(d).itemsize for d, _ in expected.values()), default=1))

        def load(rows: list[int], name: str, s: int, e: int) -> np.ndarray:
            """Rows ``rows`` of the stack, elements [s, e) of tensor ``name``, as full models in float64."""
            dtype = np.dtype(expected[name][0])
            glob = global_params[name].reshape(-1)[s:e]
            view = stack[: len(rows), : e - s]
            for i, row in enumerate(rows):
                c = counted[row]
                piece = memoryview(raw)[: (e - s) * dtype.itemsize]
                try:
                    _read_exact(handles[row], c.offsets[name] + s * dtype.itemsize, piece)
                except OSError as exc:
                    raise FlareAirflowError(
                        f"{c.path}: cannot read the update again ({exc.strerror or exc}); run the aggregation again"
                    ) from None
                values = view[i]
                values[...] = np.frombuffer(piece, dtype=dtype)
                is_diff = c.record.params_type is ParamsType.DIFF
                if c.scale < 1.0:
                    if not is_diff:
                        values -= glob
                    values *= c.scale
                    values += glob
                elif is_diff:
                    values += glob
            return view

        every = list(range(len(counted)))
        observed: np.ndarray | None = None
        if rule.observes:
            for name, ref in global_params.items():
                for s in range(0, ref.size, chunk):
                    part = rule.observe(load(every, name, s, min(s + chunk, ref.size)))
                    observed = part if observed is None else observed + part
        rows = rule.selected(observed, weights)
        chosen = weights[rows]
        for name, ref in global_params.items():
            result = np.empty(ref.shape, dtype=ref.dtype)
            flat = result.reshape(-1)
            for s in range(0, ref.size, chunk):
                e = min(s + chunk, ref.size)
                flat[s:e] = cast_back(rule.combine(load(rows, name, s, e), chosen), ref.dtype, name, sites)
            out[name] = result
    for c in counted:
        try:
            again = read_record(c.path).sha256
        except FlareAirflowError:
            again = None
        if again != c.record.sha256:
            raise FlareAirflowError(
                f"site {c.site!r}: its update {c.path} was replaced while the round was aggregated "
                f"(sha256 {c.record.sha256[:12]}… then {(again or 'none')[:12]}…); the global model was not "
                "written: run the aggregation again"
            )
    return tally.outcome(
        out,
        selected=[sites[r] for r in rows] if len(rows) != len(sites) else None,
        clipped={c.site: c.scale for c in counted if c.scale < 1.0},
    )
