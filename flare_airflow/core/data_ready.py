"""A site's announcement of fresh data, and which sites a data-driven run trains on.

An announcement is an event of the one asset :data:`SITE_DATA_ASSET`, partitioned by site: its
partition key is the site's name and its extra the site's signed record (the data's version, its
number of samples, when), nothing of the data itself. Airflow counts the partitions (the job's
wait policy); the run's ``prepare`` then proves each consumed announcement was signed by the site
it names (:func:`fresh_sites`), so a site can only announce for itself. See docs/site-admins.md.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flare_airflow.core.errors import FlareAirflowError

SITE_DATA_ASSET = "flare_airflow.site_data"
WATCH_SUFFIX = "_data_watch"  # the job DAG's companion that runs the wait and the cron fallback
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}\Z")
MAX_SAMPLES = 10**12


class AnnouncementError(FlareAirflowError):
    """An announcement that cannot be made or cannot count; the message says which and why."""


def check_version(version: str) -> str:
    if not isinstance(version, str) or not _VERSION.match(version):
        raise AnnouncementError(
            f"data version {version!r} is not allowed: use letters, digits and . _ : + -, starting with a letter "
            "or digit, at most 128 characters (e.g. 2026-12-06 or v42)"
        )
    return version


def check_samples(samples: int | None) -> int | None:
    if samples is None:
        return None
    if isinstance(samples, bool) or not isinstance(samples, int) or not 0 < samples <= MAX_SAMPLES:
        raise AnnouncementError(f"--samples {samples!r} must be a whole number from 1 to {MAX_SAMPLES}")
    return samples


def data_payload(*, site: str, version: str, samples: int | None, announced_at: dt.datetime) -> dict[str, Any]:
    """What a site signs when it announces fresh data."""
    return {
        "type": "data",
        "site": site,
        "version": check_version(version),
        "samples": check_samples(samples),
        "announced_at": announced_at.astimezone(dt.UTC).isoformat(timespec="seconds"),
    }


def announcement_id(site: str, version: str, announced_at: str) -> tuple[str, str, str]:
    """What makes two announcements one: the same site, data version and second."""
    return (site, version, announced_at)


@dataclass(frozen=True)
class SiteData:
    """One site's data as a run saw it: the announcement it trains on, or why it sits the run out."""

    site: str
    version: str | None = None
    samples: int | None = None
    announced_at: str | None = None
    reason: str | None = None  # set when the site sits the run out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "samples": self.samples, "announced_at": self.announced_at}
        if self.reason is not None:
            out["reason"] = self.reason
        return out


def _parse_time(text: Any) -> dt.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def fresh_sites(
    events: Iterable[Mapping[str, Any]],
    sites: Iterable[str],
    *,
    window_seconds: int,
    now: dt.datetime,
    verify: Any,
    used: Mapping[tuple[str, str, str], str] | None = None,
) -> dict[str, SiteData]:
    """Each of the job's ``sites``: the announcement it trains on, or why it sits the run out.

    ``events``: the run's consumed announcements as ``{"partition_key", "extra", "timestamp"}``.
    ``verify(signed, site) -> payload`` raises ``TrustError`` for a record its site did not sign.
    ``used``: announcements earlier runs trained on (:func:`announcement_id` -> run id); they never
    count again -- Airflow's own queue of partitions cannot be cleared by a run it did not start,
    so a run started by the wait or the fallback leaves them there (see docs/dag-authors.md).
    A site's newest proven announcement counts, if it is at most ``window_seconds`` old; the same
    announcement twice is one.
    """
    sites = list(sites)
    used = used or {}
    best: dict[str, dict[str, Any]] = {}
    refused: dict[str, str] = {}
    for event in events:
        site = event.get("partition_key")
        if site not in sites:
            continue
        extra = event.get("extra") or {}
        try:
            payload = verify(extra.get("signed"), site)
        except FlareAirflowError as exc:
            refused[site] = f"its announcement was refused: {exc}"
            continue
        if payload.get("type") != "data" or payload.get("site") != site:
            refused[site] = f"its announcement names site {payload.get('site')!r}, not {site!r}"
            continue
        when = _parse_time(payload.get("announced_at"))
        if when is None:
            refused[site] = "its announcement has no valid announced_at time"
            continue
        run = used.get(announcement_id(site, payload["version"], payload["announced_at"]))
        if run is not None:
            refused.setdefault(
                site, f"its data {payload['version']} announced at {payload['announced_at']} was used by run {run}"
            )
            continue
        if site not in best or when > best[site]["when"]:
            best[site] = {"when": when, "payload": payload}
    out: dict[str, SiteData] = {}
    for site in sites:
        if site not in best:
            out[site] = SiteData(site, reason=refused.get(site, "no data announced since its last run"))
            continue
        payload, when = best[site]["payload"], best[site]["when"]
        data = SiteData(site, payload["version"], payload.get("samples"), payload["announced_at"])
        age = (now - when).total_seconds()
        if age > window_seconds:
            out[site] = SiteData(
                site,
                data.version,
                data.samples,
                data.announced_at,
                reason=f"its data {data.version} announced at {data.announced_at} is older than the window "
                f"({window_seconds} s)",
            )
        else:
            out[site] = data
    return out


@dataclass(frozen=True)
class RunDecision:
    """What the job's data watch does now: start a run over ``sites``, or none (``sites`` empty), and why."""

    sites: tuple[str, ...]
    why: str


def decide_run(
    data: Mapping[str, SiteData],
    *,
    min_sites: int,
    quorum: int,
    wait_seconds: int | None,
    now: dt.datetime,
    fallback_since: dt.datetime | None = None,
    last_run_at: dt.datetime | None = None,
) -> RunDecision:
    """Whether the wait or the cron fallback starts a run now, over exactly the fresh sites.

    ``data``: :func:`fresh_sites` over the announcements no run used yet. At ``min_sites`` fresh
    sites Airflow's data schedule starts the run, never this. ``wait_seconds``: once that long has
    passed since the oldest fresh announcement, a run starts with at least ``quorum`` (the job's
    ``min_clients``) fresh sites. ``fallback_since``: the start of the cron interval that just
    ended; when no run of the job started since (``last_run_at``), a run starts with the quorum.
    """
    fresh = sorted(s for s, d in data.items() if d.reason is None)
    named = ", ".join(fresh) or "none"
    if len(fresh) >= min_sites:
        return RunDecision(
            (), f"{len(fresh)} fresh site(s) ({named}) reach min_sites {min_sites}: the data schedule starts the run"
        )
    times = [t for s in fresh if (t := _parse_time(data[s].announced_at)) is not None]
    expires = min(times) + dt.timedelta(seconds=wait_seconds) if wait_seconds is not None and times else None
    short = f"only {len(fresh)} fresh site(s) ({named}), below the quorum min_clients {quorum}"
    if expires is not None and now >= expires:
        when = expires.isoformat(timespec="seconds")
        if len(fresh) >= quorum:
            return RunDecision(tuple(fresh), f"the wait expired at {when} with {len(fresh)} fresh site(s) ({named})")
        return RunDecision((), f"the wait expired at {when} with {short}: no run until more sites announce")
    if fallback_since is not None and (last_run_at is None or last_run_at < fallback_since):
        since = fallback_since.isoformat(timespec="seconds")
        if len(fresh) >= quorum:
            return RunDecision(
                tuple(fresh), f"the schedule's fallback: no run since {since}; {len(fresh)} fresh site(s) ({named})"
            )
        return RunDecision((), f"the schedule's fallback found no run since {since} but {short}")
    until = f"the wait expires at {expires.isoformat(timespec='seconds')}" if expires else "waiting for more sites"
    return RunDecision((), f"{len(fresh)} fresh site(s) ({named}) of min_sites {min_sites}: {until}")
