"""Who trains in a run: the data-watch hand-off to ``prepare``.

A run started by the sites' data announcements (:mod:`flare_airflow.core.data_ready`) trains on the
sites whose fresh, signed, unused data it consumed; a run from the form or the data watch
(:mod:`flare_airflow.operators.data_watch`) on the sites it names. ``prepare`` records the answer in
XCom, and ``publish`` copies it into the model's lineage.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import JobConfig
from flare_airflow.core.data_ready import SITE_DATA_ASSET, fresh_sites
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.operators.common import (
    run_id_of,
)
from flare_airflow.operators.data_ready import announcement_verifier
from flare_airflow.operators.data_watch import read_history


def run_participants(
    job: JobConfig, context: Context, chosen: Sequence[str] | None, min_clients: int, *, task_id: str, log: Any
) -> dict[str, Any]:
    """The sites this run trains on, the data each trains on, and why the others sit it out.

    A run started by the sites' data trains on the sites whose announcement it consumed,
    proven, fresh and not used by an earlier run (:func:`~flare_airflow.core.data_ready.fresh_sites`);
    a run from the form (or from the data watch, :mod:`flare_airflow.operators.data_watch`) on
    the sites it names (``sites``), or all of them, recording the unused fresh data of each.
    """
    events = data_events(context)
    if events is None and not chosen and job.on_data is None:
        return {}  # every site, as before data-driven runs: nothing to record
    if job.on_data is None:
        picked = list(chosen) if chosen else list(job.sites)
        sat_out = {s: "not chosen for this run (run parameter sites)" for s in job.sites if s not in picked}
        return {"participants": picked, "sat_out": sat_out, "data": {}}
    try:
        history = read_history(context["ti"].dag_id, task_id, skip_run=run_id_of(context))
    except FlareAirflowError as exc:
        raise AirflowFailException(f"the sites' data cannot be matched to earlier runs: {exc}") from None
    window = job.on_data.window_seconds
    data = fresh_sites(
        history.events if events is None else events, job.sites, window_seconds=window, now=_now(),
        verify=announcement_verifier(log), used=history.used,
    )  # fmt: skip
    if events is None:
        picked = list(chosen) if chosen else list(job.sites)
        sat_out = {s: "not chosen for this run (run parameter sites)" for s in job.sites if s not in picked}
        # A site chosen by hand trains whatever its data; only unused fresh data is recorded as trained on.
        return {"participants": picked, "sat_out": sat_out, "data": {s: data[s].to_dict() for s in picked}}
    picked = [s for s, d in data.items() if d.reason is None and (not chosen or s in chosen)]
    sat_out = {s: d.reason or "not chosen for this run (run parameter sites)" for s, d in data.items()
               if s not in picked}  # fmt: skip
    for site, reason in sat_out.items():
        log.info("site %s sits this run out: %s", site, reason)
    if len(picked) < min_clients:
        raise AirflowFailException(
            f"only {len(picked)} site(s) have fresh, signed data ({', '.join(picked) or 'none'}), fewer than "
            f"min_clients {min_clients}: " + "; ".join(f"{s}: {r}" for s, r in sat_out.items())[:1500]
        )
    return {
        "participants": picked,
        "sat_out": sat_out,
        "data": {s: d.to_dict() for s, d in data.items()},
    }


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def data_events(context: Context) -> list[dict[str, Any]] | None:
    """The sites' announcements this run consumed, or None for a run not started by them."""
    events = context.get("triggering_asset_events") or {}
    found: list[dict[str, Any]] = []
    started_by_data = False
    for asset in list(events):
        if getattr(asset, "name", None) != SITE_DATA_ASSET:
            continue
        started_by_data = True
        for event in events[asset]:
            found.append(
                {"partition_key": event.partition_key, "extra": dict(event.extra or {}), "timestamp": event.timestamp}
            )
    return found if started_by_data else None
