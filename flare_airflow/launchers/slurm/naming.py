"""A SLURM site job's identity: its batch job's name, and where its output goes.

``fl-<job>-<site>-r<round>-<8 hex>-t<try>``: the hash covers (job, run, round, site), so every
try of one site job shares the name up to ``-t`` (:func:`site_job_prefix`) and a later try finds
the jobs of earlier tries by name (``squeue``), whichever worker submitted them.
"""

from __future__ import annotations

import hashlib
import json
import re

_NAME_PREFIX = "fl"
_MAX_PART = 40
_TRY = re.compile(r"^t(\d+)\Z")


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:8]


def _part(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "-", value).strip("-.")[:_MAX_PART].strip("-.")


def site_job_prefix(job: str, run_id: str, round_num: int, site: str) -> str:
    """The part of the job name every try of (job, run, round, site) shares, ending in ``-``."""
    if round_num < 0:
        raise ValueError(f"round ({round_num}) must be >= 0")
    parts = [_NAME_PREFIX, _part(job), _part(site), f"r{round_num}", _digest(job, run_id, round_num, site)]
    return "-".join(p for p in parts if p) + "-"


def job_name(job: str, run_id: str, round_num: int, site: str, try_number: int) -> str:
    """The batch job's name: ``fl-<job>-<site>-r<round>-<8 hex>-t<try>`` (letters, digits, ``_.-``)."""
    if try_number < 0:
        raise ValueError(f"try ({try_number}) must be >= 0")
    return f"{site_job_prefix(job, run_id, round_num, site)}t{try_number}"


def try_of(name: str, prefix: str) -> int | None:
    """The try number of a job named ``name`` if it belongs to the site job of ``prefix``."""
    if not name.startswith(prefix):
        return None
    match = _TRY.match(name[len(prefix) :])
    return int(match.group(1)) if match else None


def output_file(output_dir: str, name: str) -> str:
    """The batch job's output file (stdout and stderr) in ``output_dir`` on the cluster."""
    return f"{output_dir.rstrip('/')}/{name}.out"
