"""operators/slurm.py without a cluster: a SLURM site task resumed with an event that says its job
may still run ends that job (``scancel`` by the event's job id) and fails with the event's return
code; a cancel that fails is logged, never raised over the site's own failure. The real
submit, watch and cancel run against a real SLURM cluster (tests/integration/slurm)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from flare_airflow.core.spec import JobReturnCode
from flare_airflow.launchers.slurm import SlurmCommandError
from flare_airflow.operators import slurm
from flare_airflow.operators.site_steps import SiteJobFailed
from tests.unit.airflow_layer import context, make_job
from tests.unit.operators.fake_site_task import PushingTI

SITES = {"site-1": {"launcher": "slurm", "launcher_spec": {"slurm": {"partition": "gpu"}}}}


@pytest.fixture
def cancelled(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []

    def cancel(commands: Any, job_ids: list[str]) -> None:
        if job_ids == ["refused"]:
            raise SlurmCommandError("scancel: Invalid job id specified")
        calls.append(job_ids)

    monkeypatch.setattr(slurm, "cancel", cancel)
    monkeypatch.setattr(slurm, "slurm_commands", lambda spec: None)
    return calls


def test_a_resumed_timeout_cancels_the_job_it_names_and_fails_with_its_return_code(
    cancelled: list[list[str]], tmp_path: pathlib.Path
) -> None:
    task = slurm.SiteSlurmOperator(
        task_id="t", job=make_job(tmp_path, sites=SITES, min_clients=1), site="site-1", round_num=1
    )
    event = {"status": "timeout", "job_id": "42", "return_code": int(JobReturnCode.ABORTED), "reason": "pending"}
    with pytest.raises(SiteJobFailed, match=r"pending \[ABORTED\]"):
        task.resume(context(PushingTI()), event)
    assert cancelled == [["42"]]


def test_a_cancel_that_fails_is_logged_and_an_event_without_a_job_cancels_nothing(
    cancelled: list[list[str]],
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    task = slurm.SiteSlurmOperator(
        task_id="t", job=make_job(tmp_path, sites=SITES, min_clients=1), site="site-1", round_num=1
    )
    task.end_watched_job({"status": "error"})
    assert cancelled == []
    task.end_watched_job({"status": "error", "job_id": "refused"})
    logged = capsys.readouterr().out + caplog.text  # the operator's log: structlog's stdout, or logging's
    assert "could not cancel SLURM job refused: scancel: Invalid job id specified" in logged
