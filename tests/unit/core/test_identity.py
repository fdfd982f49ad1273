"""A site job's identity: what finds a launch again (JobIdentity), per backend."""

from __future__ import annotations

import pytest

from flare_airflow.core.spec import JobIdentity, SiteJob
from flare_airflow.launchers.kubernetes.naming import pod_labels, site_job_selector
from flare_airflow.launchers.process.launcher import ProcessLauncher
from flare_airflow.launchers.slurm import job_name


def test_an_identity_travels_as_a_dict_and_names_its_launch() -> None:
    identity = JobIdentity.of(SiteJob("digits", "manual__1", 3, "site-2", argv=("x",)), try_number=2)
    assert identity == JobIdentity("digits", "manual__1", 3, "site-2", 2)
    assert JobIdentity.from_dict(identity.to_dict()) == identity
    assert identity.label == "digits/site-2/r3/t2"
    assert identity.site_job().label == "digits/site-2/r3"


@pytest.mark.parametrize("data", [{}, {"job": "j", "run_id": "r", "round": "x", "site": "s"}, None])
def test_a_malformed_identity_is_refused_naming_what_it_needs(data: object) -> None:
    with pytest.raises(ValueError, match="needs job, run_id, round, site and try_number"):
        JobIdentity.from_dict(data)  # type: ignore[arg-type]


def test_the_pod_selector_of_a_launch_matches_its_labels_and_no_other_try() -> None:
    identity = JobIdentity("digits", "manual__1", 3, "site-2", 2)
    labels = pod_labels("digits", "manual__1", 3, "site-2", 2)
    terms = dict(term.split("=", 1) for term in site_job_selector(identity).split(","))
    assert all(labels[key] == value for key, value in terms.items())
    assert terms["flare-airflow/try"] == "2" and terms["flare-airflow/site"] == "site-2"
    assert job_name("digits", "manual__1", 3, "site-2", 2).endswith("-t2")


def test_a_process_launch_cannot_be_found_again_and_says_why() -> None:
    with pytest.raises(NotImplementedError, match="ends with the task that launched it"):
        ProcessLauncher().find_job(JobIdentity("digits", "manual__1", 1, "site-1"))
