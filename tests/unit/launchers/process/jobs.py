"""Shared builders for the process backend's unit tests."""

from __future__ import annotations

import sys

from flare_airflow.core.spec import JobReturnCode, SiteJob

PY = sys.executable


RC = JobReturnCode


def site_job(argv: list[str], **kw) -> SiteJob:
    return SiteJob(job="demo", run_id="run-1", round=2, site="site-1", argv=tuple(argv), **kw)
