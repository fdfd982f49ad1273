"""What a round leaves behind: its server state, its central-DP release record and its global model
written to the model store in the one order a killed task can resume from, and the round summary's
fields that come from the aggregation.

Airflow-free: the aggregation operator (``operators/aggregate.py``) signs the global model this wrote,
adds the next round's sealed links, the evaluation and the privacy account to the summary, and turns
:class:`~flare_airflow.core.errors.RoundWriteError` and
:class:`~flare_airflow.core.errors.RoundInputError` into a failed task with their message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flare_airflow.core.aggregation.round import record_central_release
from flare_airflow.core.aggregation.tally import RoundOutcome
from flare_airflow.core.errors import RoundWriteError
from flare_airflow.core.model import ArtifactRecord, FLModel, Params, WritablePath, write_artifact
from flare_airflow.core.store import ModelStore


@dataclass(frozen=True)
class RoundWritten:
    """What :func:`write_round` wrote: the global model's place and record, the server state's
    record (None for a stateless strategy) and the run's distinct central-DP releases so far (None
    without central DP)."""

    global_model: WritablePath
    record: ArtifactRecord
    state_record: ArtifactRecord | None = None
    central_releases: int | None = None


def _write(path: WritablePath, model: FLModel, round_num: int, what: str) -> ArtifactRecord:
    try:
        return write_artifact(path, model)
    except OSError as exc:
        raise RoundWriteError(
            f"round {round_num}: cannot write {what} {path}: {exc.strerror or exc}. The model store "
            "is full or not writable: fix it, then resume the run from this round"
        ) from None


def write_round(
    store: ModelStore,
    job: str,
    run_id: str,
    round_num: int,
    outcome: RoundOutcome,
    *,
    strategy: str,
    state: tuple[WritablePath, Params] | None = None,
    central_dp: bool = False,
    accepted_sha256: Mapping[str, str] | None = None,
) -> RoundWritten:
    """Write round ``round_num``'s outputs: the server state (``state``: where it goes and the
    strategy's new state; None for a stateless strategy), then, with ``central_dp``, the central
    release (the accepted sites with the sha256 each site task accepted, ``accepted_sha256``), then
    the global model (``outcome``'s params, named by ``strategy`` in the state's meta).

    The order is what makes a retry safe. The state goes before the global model: a task killed
    between the two is run again from the previous round's state, which it never overwrites, and
    writes the same bytes again. The release is recorded before it is written, so a distinct sum is
    charged once however often it is retried.

    Raises :class:`~flare_airflow.core.errors.RoundWriteError` when the store refuses the state or
    the global model, :class:`~flare_airflow.core.errors.RoundInputError` when it refuses the
    release record; nothing after the failed write is written.
    """
    r = round_num
    state_record = None
    if state is not None:
        state_out, new_state = state
        state_record = _write(
            state_out, FLModel(params=new_state, meta={"round": r, "strategy": strategy}), r, "the server state"
        )
    central_releases = None
    if central_dp:
        accepted = accepted_sha256 or {}
        central_releases = record_central_release(store, job, run_id, r, {s: accepted.get(s) for s in outcome.accepted})
    global_out = store.global_model(job, run_id, r)
    record = _write(
        global_out,
        FLModel(
            params=outcome.params,
            metrics=outcome.metrics,
            meta={"round": r, "sites": sorted(outcome.accepted), "num_samples_total": outcome.num_samples},
        ),
        r,
        "the global model",
    )
    return RoundWritten(global_out, record, state_record, central_releases)


def round_summary(
    written: RoundWritten,
    outcome: RoundOutcome,
    *,
    round_num: int,
    strategy: str,
    strategy_params: Mapping[str, Any],
    site_sha256: Mapping[str, str] | None,
    signed: Mapping[str, Any],
    links: Mapping[str, Any] | None = None,
    evaluation: Mapping[str, float],
    privacy: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The round's summary (the aggregation task's XCom), its keys in the order the runs page,
    tracking and publish have always read them.

    From the aggregation: the global model and its digest, who counted and who did not, the
    strategy, the state's digests, a selecting rule's choice, the clip factors, the samples and the
    metrics. From the caller, as plain data: ``signed`` (the central side's signature on the global
    model), ``links`` (the next round's sealed store links, keyed as the summary carries them; None
    or empty on a local store), ``evaluation`` and ``privacy`` (the run's account after this round,
    or None). ``site_sha256``: the update each site task vouched for (None for rounds aggregated
    without site task ids).
    """
    state = written.state_record
    return {
        "round": round_num,
        "global_uri": str(written.global_model),
        "sha256": written.record.sha256,
        # The central side's signature on (job, run, round, digests): each site verifies it before training.
        "signed": signed,
        # The next round's store links, each sealed to its site's box key (none on a local store).
        **(dict(links) if links else {}),
        "accepted": sorted(outcome.accepted),
        # The update each site task vouched for when this round was aggregated: publish checks
        # that no site task was re-run (or failed) afterwards, which would make this model stale.
        "site_sha256": dict(sorted(site_sha256.items())) if site_sha256 is not None else None,
        "rejected": outcome.rejected,
        "strategy": strategy,
        # What the runs page names next to the strategy: the job's aggregator block as written.
        "strategy_params": strategy_params,
        # The next round reads this state only if its record still names these digests.
        **({"state_sha256": state.sha256} if state is not None else {}),
        **({"state_blake3": state.blake3} if state is not None and state.blake3 else {}),
        **({"selected": outcome.selected} if outcome.selected is not None else {}),
        **({"clipped": outcome.clipped} if outcome.clipped else {}),
        "num_samples": outcome.num_samples,
        "metrics": outcome.metrics,
        "site_metrics": outcome.site_metrics,
        "evaluation": evaluation,
        # The run's ε after this round (the job's own noise, over every distinct release), or None.
        "privacy": privacy,
    }
