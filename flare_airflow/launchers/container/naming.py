"""A container site job's identity: its container's name and labels.

The labels carry the whole identity (job, run, round, site, try), so a later try, a sensor in
another process or the run's sweep finds the container with ``ps --filter label=...``, whichever
worker started it. The name is for people (``podman ps``): ``fl-<job>-<site>-r<round>-<8 hex>-t<try>``.
"""

from __future__ import annotations

import hashlib
import json
import re

from flare_airflow.core.spec import JobIdentity

LABEL_PREFIX = "flare-airflow."
MANAGED_BY = ("app.kubernetes.io/managed-by", "flare-airflow")
_MAX_PART = 40


def _part(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "-", value).strip("-.")[:_MAX_PART].strip("-.")


def run_digest(job: str, run_id: str) -> str:
    """A short digest of (job, run): the label value every container of one run shares."""
    return hashlib.sha256(json.dumps([job, run_id]).encode()).hexdigest()[:16]


def container_name(identity: JobIdentity) -> str:
    digest = hashlib.sha256(
        json.dumps([identity.job, identity.run_id, identity.round, identity.site]).encode()
    ).hexdigest()[:8]
    parts = ["fl", _part(identity.job), _part(identity.site), f"r{identity.round}", digest, f"t{identity.try_number}"]
    return "-".join(p for p in parts if p)


def labels(identity: JobIdentity) -> dict[str, str]:
    """The container's labels: who manages it and which launch of which site job it is."""
    return {
        MANAGED_BY[0]: MANAGED_BY[1],
        LABEL_PREFIX + "run": run_digest(identity.job, identity.run_id),
        LABEL_PREFIX + "job": identity.job,
        LABEL_PREFIX + "run-id": identity.run_id,
        LABEL_PREFIX + "round": str(identity.round),
        LABEL_PREFIX + "site": identity.site,
        LABEL_PREFIX + "try": str(identity.try_number),
    }


def site_job_filters(identity: JobIdentity, *, with_try: bool) -> list[str]:
    """``--filter`` values selecting this site job's containers (one try's, or every try's)."""
    wanted = labels(identity)
    keys = [MANAGED_BY[0], *(LABEL_PREFIX + k for k in ("run", "round", "site"))]
    if with_try:
        keys.append(LABEL_PREFIX + "try")
    return [f"label={key}={wanted[key]}" for key in keys]


def run_filters(job: str, run_id: str) -> list[str]:
    """``--filter`` values selecting every container of one run (the sweep's)."""
    return [f"label={MANAGED_BY[0]}={MANAGED_BY[1]}", f"label={LABEL_PREFIX}run={run_digest(job, run_id)}"]
