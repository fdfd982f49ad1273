"""Trust in the Airflow layer: this worker's trust settings, the central side's signature on a
global model, the aggregation's verification of the sites' signed update records.

The maths and the formats are in :mod:`flare_airflow.core.trust`; this module only reads Airflow's
configuration and turns refusals into what a task does with them (docs/threat-model.md).
"""

from __future__ import annotations

import json
import os
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
