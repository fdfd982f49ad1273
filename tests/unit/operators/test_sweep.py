"""The run's sweeps: one per queue the backend's sites use, each ending its own sites' jobs as the
worker's site policy makes them."""

from __future__ import annotations

import json
import pathlib

import pytest

from flare_airflow.builder import build_dag
from flare_airflow.operators.container import SweepContainersOperator
from flare_airflow.operators.site_steps import SITE_CONFIG_ENV
from tests.unit.airflow_layer import make_job


def container(engine: str = "podman", **site: object) -> dict[str, object]:
    return {"launcher": "container", "launcher_spec": {"container": {"image": "trainer:1", "engine": engine}}, **site}


@pytest.fixture
def job(tmp_path: pathlib.Path):
    sites = {
        "site-1": container(),
        "site-2": container(queue="hospital-b", executor="EdgeExecutor"),
        "site-3": container(queue="hospital-b", executor="EdgeExecutor"),
        "site-4": {},
    }
    return make_job(tmp_path, min_clients=1, sites=sites)


def test_each_queue_of_the_sites_gets_its_own_sweep_routed_there(job) -> None:
    dag = build_dag(job)
    sweeps = {tid: t for tid, t in dag.task_dict.items() if tid.startswith("sweep_")}
    assert sorted(sweeps) == ["sweep_containers", "sweep_containers_hospital-b"]
    central, site = sweeps["sweep_containers"], sweeps["sweep_containers_hospital-b"]
    assert isinstance(site, SweepContainersOperator) and site.is_teardown
    assert central.sites == ["site-1"] and central.queue == dag.task_dict["round_1.site-1"].queue
    assert site.sites == ["site-2", "site-3"]
    assert (site.queue, site.executor) == ("hospital-b", "EdgeExecutor")
    assert (site.queue, site.executor) == (
        dag.task_dict["round_1.site-2"].queue,
        dag.task_dict["round_1.site-2"].executor,
    )
    assert sorted(site.swept_sites()) == ["site-2", "site-3"]


def test_one_queue_through_two_executors_gets_two_sweeps(tmp_path: pathlib.Path) -> None:
    sites = {"a": container(queue="q"), "b": container(queue="q", executor="EdgeExecutor")}
    dag = build_dag(make_job(tmp_path, min_clients=1, sites=sites))
    assert sorted(t for t in dag.task_dict if t.startswith("sweep_")) == [
        "sweep_containers_q",
        "sweep_containers_q_EdgeExecutor",
    ]


def test_a_sweep_on_a_sites_worker_reads_the_engine_from_the_site_policy(
    job, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = tmp_path / "site.yaml"
    policy.write_text(json.dumps({"sites": {"site-2": container(engine="docker")}}))
    monkeypatch.setenv(SITE_CONFIG_ENV, str(policy))
    sweep = SweepContainersOperator(task_id="s", job=job, sites=["site-2", "site-3"])
    swept = sweep.swept_sites()
    assert swept["site-2"].launcher_spec.container.engine == "docker"  # the policy's
    # a site the policy does not cover keeps the job's spec (and the reason is logged)
    assert swept["site-3"].launcher_spec.container.engine == "podman"


def test_a_policy_that_cannot_be_read_leaves_the_jobs_specs(job, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SITE_CONFIG_ENV, str(tmp_path / "missing.yaml"))
    swept = SweepContainersOperator(task_id="s", job=job).swept_sites()
    assert sorted(swept) == ["site-1", "site-2", "site-3"]
