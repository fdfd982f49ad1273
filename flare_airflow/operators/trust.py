"""Trust in the Airflow layer: this worker's trust settings, the central side's signature on a
global model, the aggregation's verification of the sites' signed update records.

The maths and the formats are in :mod:`flare_airflow.core.trust`; this module only reads Airflow's
configuration and turns refusals into what a task does with them (docs/threat-model.md).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flare_airflow.core import envvars
from flare_airflow.core.trust import CENTRAL, TrustError, global_payload, sign_record
from flare_airflow.core.trust.settings import TrustSettings


def trust_settings() -> TrustSettings:
    """This worker's trust settings: ``$FLARE_KEY_DIR`` / ``[flare] key_dir`` (default
    ``$AIRFLOW_HOME/flare-keys``), and the registry ``$FLARE_SITE_KEYS`` / ``[flare] site_keys``
    (strict mode when set)."""
    from airflow.configuration import AIRFLOW_HOME, conf

    key_dir = os.environ.get(envvars.FLARE_KEY_DIR) or conf.get("flare", "key_dir", fallback=None)
    registry = os.environ.get(envvars.FLARE_SITE_KEYS) or conf.get("flare", "site_keys", fallback=None)
    return TrustSettings(key_dir=key_dir or os.path.join(AIRFLOW_HOME, "flare-keys"), registry_path=registry or None)


def sign_global(job: str, run_id: str, round_num: int, record: Any) -> dict[str, Any]:
    """The central side's signed record of the global model it just wrote after ``round_num``
    (``record``: its :class:`~flare_airflow.core.model.ArtifactRecord`). Raises ``TrustError``
    when the central signing key is missing (strict mode) -- the round must not publish unsigned."""
    kid, key = trust_settings().signing_key(CENTRAL)
    payload = global_payload(
        job=job, run_id=run_id, round_num=round_num, size=record.size, sha256=record.sha256, blake3=record.blake3
    )
    return sign_record(payload, kid, key)


def open_reports(
    summaries: Mapping[str, Any], *, job: str, run_id: str, round_num: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each site's XCom summary with its sealed report opened (with the central box key, for this
    job, run, round and site), and site -> why a report was refused. A refused report's site does
    not count: its summary is left out, never taken in clear."""
    from flare_airflow.core.trust.sealed import REPORT_FIELDS, REPORT_KEY, load_box_key, open_sealed, report_context

    opened: dict[str, Any] = {}
    refused: dict[str, str] = {}
    box = None
    for site, summary in summaries.items():
        if not isinstance(summary, dict) or REPORT_KEY not in summary:
            opened[site] = summary
            continue
        what = f"round {round_num}: site {site!r}'s sealed report"
        try:
            box = box or load_box_key(Path(trust_settings().key_dir), CENTRAL)
            bound = report_context(job, run_id, round_num, site)
            text = open_sealed(box, summary[REPORT_KEY], context=bound, what=what)
            report = json.loads(text)
            if not isinstance(report, dict) or set(report) - set(REPORT_FIELDS):
                raise TrustError(f"{what} holds other fields than {', '.join(REPORT_FIELDS)}")
        except (TrustError, ValueError) as exc:
            refused[site] = f"refused: {exc}"
            continue
        opened[site] = {**{k: v for k, v in summary.items() if k != REPORT_KEY}, **report}
    return opened, refused


def verify_updates(
    summaries: Mapping[str, Any], *, job: str, run_id: str, round_num: int, log: Any
) -> tuple[dict[str, str], dict[str, str | None], dict[str, str]]:
    """Check each site's update record (its task's XCom) against the site's signature.

    Returns (site -> sha256, site -> BLAKE3, site -> reason refused). The digests returned are
    the signed ones: nothing of a record counts unless its site signed it for this job, run,
    round and slot. A site whose record is refused does not count; the round goes on with the
    others (quorum decides).
    """
    settings = trust_settings()
    registry = None
    accepted: dict[str, str] = {}
    blake3: dict[str, str | None] = {}
    refused: dict[str, str] = {}
    for site, summary in sorted(summaries.items()):
        if not isinstance(summary, dict) or not summary.get("sha256"):
            continue
        what = f"round {round_num}: site {site!r}'s update record"
        expect = {"job": job, "run_id": run_id, "round": round_num, "site": site, "sha256": summary["sha256"]}
        if summary.get("blake3"):
            expect["blake3"] = summary["blake3"]
        try:
            registry = registry or settings.registry()
            payload, note = settings.verify(
                summary.get("signed"), party=site, expect=expect, what=what, registry=registry
            )
        except TrustError as exc:
            refused[site] = f"refused: {exc}"
            continue
        if note is not None:
            log.warning("%s", note)
        accepted[site] = str(summary["sha256"])
        blake3[site] = str(summary["blake3"]) if summary.get("blake3") else None
        if payload is not None and payload.get("blake3") and not summary.get("blake3"):
            blake3[site] = str(payload["blake3"])
    return accepted, blake3, refused


#: The aggregation summary's per-site metrics: every site's metrics, sealed to the central box key
#: in strict mode (the summary is XCom, which every site task can read).
SITE_METRICS_KEY = "site_metrics"


def seal_site_metrics(summary: Mapping[str, Any], *, job: str, run_id: str) -> dict[str, Any]:
    """The aggregation's summary as it goes to XCom: in strict mode its per-site metrics sealed to
    the central box key for (job, run, round), so only the central side (publish, tracking, the runs
    page) reads them; unchanged on one machine. Fails the task when the central box key is missing
    (strict mode): the metrics must not go out in clear instead."""
    out = dict(summary)
    metrics = out.get(SITE_METRICS_KEY)
    if not trust_settings().strict or not isinstance(metrics, Mapping):
        return out
    from flare_airflow.core.trust.keys import key_id
    from flare_airflow.core.trust.sealed import load_box_key, seal, site_metrics_context

    try:
        public = load_box_key(Path(trust_settings().key_dir), CENTRAL).public_key()
    except TrustError as exc:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(f"round {out.get('round')}: the per-site metrics cannot be sealed: {exc}") from None
    context = site_metrics_context(job, run_id, int(out["round"]))
    out[SITE_METRICS_KEY] = seal(public, key_id(CENTRAL, public), json.dumps(dict(metrics)).encode(), context=context)
    return out


def open_site_metrics(summary: Mapping[str, Any], *, job: str, run_id: str) -> dict[str, Any]:
    """An aggregation summary with its sealed per-site metrics opened (central side only); a
    summary in clear is returned as is. Raises ``TrustError`` when they do not open here."""
    out = dict(summary)
    sealed = out.get(SITE_METRICS_KEY)
    if not isinstance(sealed, str):
        return out
    from flare_airflow.core.trust.sealed import load_box_key, open_sealed, site_metrics_context

    r = out.get("round")
    what = f"round {r}'s per-site metrics"
    box = load_box_key(Path(trust_settings().key_dir), CENTRAL)
    text = open_sealed(box, sealed, context=site_metrics_context(job, run_id, int(str(r))), what=what)
    try:
        metrics = json.loads(text)
    except ValueError:
        raise TrustError(f"{what} opened but are not JSON") from None
    if not isinstance(metrics, dict):
        raise TrustError(f"{what} opened but are not a site -> metrics object")
    out[SITE_METRICS_KEY] = metrics
    return out


def open_run_xcoms(xcoms: Mapping[str, Any], *, prefix: str, run_id: str) -> tuple[dict[str, Any], list[str]]:
    """A run's XComs (task id -> return value) as the central side reads them: each site task's
    sealed report and each round's sealed per-site metrics opened with the central box key, for the
    job the ``prepare`` task names. Returns (xcoms, why each sealed value that did not open did not):
    a value that does not open is left sealed -- its figures stay unknown, never guessed."""
    job = (xcoms.get(prefix + "prepare") or {}).get("job") if isinstance(xcoms.get(prefix + "prepare"), dict) else None
    out = dict(xcoms)
    problems: list[str] = []
    if not isinstance(job, str):
        return out, problems
    task = re.compile(rf"^{re.escape(prefix)}round_(\d+)\.([^.]+)\Z")
    by_round: dict[int, dict[str, str]] = {}
    for task_id, value in xcoms.items():
        m = task.match(task_id)
        if m is None or not isinstance(value, dict):
            continue
        if isinstance(value.get(SITE_METRICS_KEY), str):
            try:
                out[task_id] = open_site_metrics(value, job=job, run_id=run_id)
            except (TrustError, ValueError) as exc:
                problems.append(f"{task_id}: {exc}")
        else:
            by_round.setdefault(int(m.group(1)), {})[m.group(2)] = task_id
    from flare_airflow.core.trust.sealed import REPORT_KEY

    for r, tasks in by_round.items():
        sealed = {site: xcoms[t] for site, t in tasks.items() if REPORT_KEY in xcoms[t]}
        if not sealed:
            continue
        try:
            opened, refused = open_reports(sealed, job=job, run_id=run_id, round_num=r)
        except TrustError as exc:  # the central box key is not on this server
            problems.append(f"round {r}: {exc}")
            continue
        out.update({tasks[site]: summary for site, summary in opened.items()})
        problems += [f"{tasks[site]}: {why}" for site, why in refused.items()]
    return out, problems
