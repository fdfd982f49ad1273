"""SiteJobSensor's decisions that need no cluster: where the identity comes from, and a backend
that cannot be asked (a retryable error, not the job's failure)."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from flare_airflow.core.spec import JobIdentity
from flare_airflow.sensors.site_job import SiteJobSensor
from tests.unit.airflow_layer import RUN_ID, FakeTI, context, make_job

SLURM_UNREACHABLE = {"launcher": "slurm", "launcher_spec": {"slurm": {"connection": "ssh:no_such_login_node"}}}


def sensor(tmp_path, **kwargs) -> SiteJobSensor:
    job = make_job(tmp_path, sites={"site-1": SLURM_UNREACHABLE}, min_clients=1)
    return SiteJobSensor(task_id="site-1", job=job, site="site-1", round_num=1, **kwargs)


def test_a_backend_that_cannot_be_asked_is_a_retryable_error_naming_the_job(tmp_path) -> None:
    identity = JobIdentity("unit", RUN_ID, 1, "site-1", 2).to_dict()
    with pytest.raises(AirflowException) as raised:
        sensor(tmp_path, identity=identity).poke(context())
    assert not isinstance(raised.value, AirflowFailException), "a retry looks again; soft_fail does not skip it"
    assert "cannot look for site job unit/site-1/r1/t2" in str(raised.value)
    assert "no_such_login_node" in str(raised.value) and "[INFRASTRUCTURE_ERROR]" in str(raised.value)


def test_no_identity_in_the_launch_tasks_xcom_fails_saying_what_to_clear(tmp_path) -> None:
    with pytest.raises(AirflowFailException, match="site-1_launch left no site job identity"):
        sensor(tmp_path, launch_task_id="site-1_launch").poke(context(FakeTI()))


def test_an_identity_of_another_site_job_is_refused(tmp_path) -> None:
    ti = FakeTI(xcoms={("site-1_launch", "return_value"): JobIdentity("unit", RUN_ID, 2, "site-1").to_dict()})
    with pytest.raises(AirflowFailException, match="the identity it was given is of unit/site-1/r2/t1"):
        sensor(tmp_path, launch_task_id="site-1_launch").poke(context(ti))
