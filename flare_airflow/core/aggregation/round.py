"""What a round keeps in the model store besides its global model: the server state carried from
round to round, and the central-DP releases recorded before a model is released.

Airflow-free: the aggregation operator passes in what the previous round published (its XCom) and
turns :class:`~flare_airflow.core.errors.RoundInputError` into a failed task.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

from flare_airflow.core.digests import BLAKE3, available
from flare_airflow.core.errors import FlareAirflowError, RoundInputError
from flare_airflow.core.failure_record import read_failure
from flare_airflow.core.model import Params, WritablePath, atomic_write, read_record, read_verified
from flare_airflow.core.privacy.central import CENTRAL_RELEASES_FILE, central_release_id
from flare_airflow.core.store import ModelStore, record_path


def previous_server_state(
    store: ModelStore,
    job: str,
    run_id: str,
    round_num: int,
    *,
    strategy: str,
    published_sha256: str | None,
    published_blake3: str | None,
) -> tuple[Params, WritablePath]:
    """The previous round's server state (empty before round 1) and where this round's goes.

    The previous state's record must name the digests the previous aggregation published
    (``published_*``, from its summary) and the file must match its record; otherwise the state was
    replaced or damaged after it was published and the round must not build on it.
    """
    r = round_num
    out = store.server_state(job, run_id, r)
    if r == 1:
        return {}, out
    previous = store.server_state(job, run_id, r - 1)
    if not record_path(previous).exists():
        raise RoundInputError(
            f"round {r}: the server state of round {r - 1} ({strategy}'s moments) is missing at "
            f"{previous}; resume the run from round {r - 1} to rebuild it"
        )
    try:
        record = read_record(previous)
    except FlareAirflowError as exc:
        raise RoundInputError(f"round {r}: the server state of round {r - 1} is unusable: {exc}") from None
    for algorithm, recorded, pinned in (
        ("sha256", record.sha256, published_sha256),
        ("blake3", record.blake3, published_blake3),
    ):
        if pinned and recorded != pinned:
            raise RoundInputError(
                f"round {r}: the server state {previous} was replaced after round {r - 1} published it "
                f"({algorithm} {(recorded or 'none')[:12]}…, published {str(pinned)[:12]}…); clear round {r - 1} "
                "to rebuild it"
            )
    # The record is pinned by both digests: verifying the file by the faster one (BLAKE3) is
    # verifying it by both, as for the sites' updates; without a BLAKE3 pin, every digest.
    algorithms = (BLAKE3,) if published_blake3 and BLAKE3 in available() else None
    try:
        state = read_verified(previous, record, algorithms=algorithms)
    except FlareAirflowError as exc:
        raise RoundInputError(f"round {r}: the server state of round {r - 1} is unusable: {exc}") from None
    except OSError as exc:
        raise RoundInputError(
            f"round {r}: cannot read the server state of round {r - 1} ({exc.strerror or exc}); resume the run "
            f"from round {r - 1} to rebuild it"
        ) from None
    return state, out


def _release_ids(path: WritablePath, round_num: int) -> list[str]:
    """The release names recorded at ``path`` ([] when there is none yet).

    A record that cannot be read as such is refused, never taken as empty: the run's ε counts every
    release recorded there, and a record reset by damage would spend the budget again unseen.
    """
    if not path.exists():
        return []
    try:
        with path.open("rb") as fh:
            data = json.loads(fh.read(_RELEASES_MAX_BYTES + 1))
        problem = None if _is_release_list(data) else "not a list of release names"
    except OSError as exc:
        problem = str(exc.strerror or exc)
    except ValueError as exc:  # not JSON (or cut off at the size cap)
        problem = f"not JSON: {exc}"
    if problem is not None:
        raise RoundInputError(
            f"round {round_num}: the central-DP release record {path} is unusable ({problem}); the run's ε counts "
            "every release recorded there, so nothing was released. Restore the file, then clear this task"
        )
    return list(data)


# A release name is a sha256 (64 hex digits): 1 MiB holds ~15,000 releases of one round.
_RELEASES_MAX_BYTES = 1 << 20


def _is_release_list(data: object) -> bool:
    return isinstance(data, list) and all(
        isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x) for x in data
    )


def record_central_release(
    store: ModelStore, job: str, run_id: str, round_num: int, accepted: Mapping[str, str | None]
) -> int:
    """Record this round's central release (its accepted set, site -> update sha256) in the round's
    folder before the model is written, so a retried round charges the same release once; return the
    run's distinct central releases so far, over rounds 1..this one (docs/privacy.md)."""
    r = round_num
    path = store.round_dir(job, run_id, r) / CENTRAL_RELEASES_FILE
    ids = _release_ids(path, r)
    release = central_release_id(r, accepted)
    if release not in ids:
        ids.append(release)
        try:
            atomic_write(path, json.dumps(ids).encode())
        except OSError as exc:
            raise RoundInputError(
                f"round {r}: cannot record the central-DP release in the model store: {exc.strerror or exc}; "
                "nothing was released. Fix the store, then clear this task"
            ) from None
    return len(ids) + sum(
        len(_release_ids(store.round_dir(job, run_id, k) / CENTRAL_RELEASES_FILE, r)) for k in range(1, r)
    )


def round_inputs(
    store: ModelStore,
    job: str,
    run_id: str,
    round_num: int,
    sites: Sequence[str],
    *,
    sat_out: Mapping[str, str],
    refused: Mapping[str, str],
    accepted: Mapping[str, str] | None,
    task_failure: Callable[[str], str | None],
) -> list[tuple[str, WritablePath | None, str | None]]:
    """``(site, update, why not)`` of each site for the aggregation: its update's place, or None and
    the reason it does not count.

    ``sat_out``: sites that sit the run out; ``refused``: sites whose signed record was refused;
    ``accepted``: site -> the digest its site task accepted (None: rounds aggregated without task
    ids, where a published update counts); ``task_failure``: the reason a site task gave when it
    failed, read before the site's failure record (the store may not have taken it).
    """
    updates: list[tuple[str, WritablePath | None, str | None]] = []
    for site in sites:
        # The update's place comes from the site's name, never from its XCom (docs/threat-model.md).
        path = store.site_update(job, run_id, round_num, site)
        if site in sat_out:
            updates.append((site, None, f"sat this run out: {sat_out[site]}"))
        elif site in refused:
            updates.append((site, None, refused[site]))
        elif accepted is not None and site not in accepted:
            # Only what the site task itself accepted counts: a failed task's trainer may have
            # written a file (late, or before failing), and it must not count.
            reason = (
                task_failure(site)
                or read_failure(path)
                or "no accepted update: the site task failed, was skipped or never ran"
            )
            updates.append((site, None, reason))
        elif record_path(path).exists():
            updates.append((site, path, None))
        else:
            reason = read_failure(path) or "no update: the site task failed before its trainer ran, or never ran"
            updates.append((site, None, reason))
    return updates
