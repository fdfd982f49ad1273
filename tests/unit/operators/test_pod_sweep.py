"""operators/pod_sweep.py: the run's teardown for pod sites -- here what a killed try left in the
folder a pod site shares with its worker (the pods themselves: tests/integration/k8s/)."""

from __future__ import annotations

import pathlib

from flare_airflow.operators.pod_sweep import SweepPodsOperator
from tests.unit.airflow_layer import make_job


def test_the_runs_links_staging_of_its_pod_sites_is_removed_and_nothing_else(tmp_path: pathlib.Path) -> None:
    """A try killed outright (kill -9: no on_kill) keeps its staging folder -- a copy of the round's
    global model, perhaps an update -- and the last try has no later try to clear it."""
    mount = tmp_path / "mount"
    k8s = {"image": "img:1", "store_mount": {"host_path": str(mount), "mount_path": "/s"}}
    site = {"launcher": "k8s", "launcher_spec": {"k8s": k8s}}
    job = make_job(tmp_path, sites={"site-1": site, "site-2": {}}, min_clients=1)
    top = mount / "links-staging" / "unit"
    left = [top / "run-a" / f"round-000{r}" / "site-1" / "try-1" / "global" / "global.safetensors" for r in (1, 2)]
    kept = [
        top / "run-a" / "round-0001" / "site-9" / "try-1" / "out" / "u",  # not a site this sweep serves
        top / "run-b" / "round-0001" / "site-1" / "try-1" / "out" / "u",  # another run
    ]
    for path in left + kept:
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")

    removed = SweepPodsOperator(task_id="sweep_pods", job=job).sweep_links_staging({"run_id": "run-a"})

    assert sorted(removed) == [str(top / "run-a" / f"round-000{r}" / "site-1") for r in (1, 2)]
    assert not any(p.exists() for p in left)
    assert all(p.exists() for p in kept)
    assert not (top / "run-a" / "round-0002").exists()  # emptied: removed too


def test_a_job_whose_pod_sites_share_no_folder_sweeps_nothing(tmp_path: pathlib.Path) -> None:
    site = {"launcher": "k8s", "launcher_spec": {"k8s": {"image": "img:1"}}}
    job = make_job(tmp_path, sites={"site-1": site}, min_clients=1)
    assert SweepPodsOperator(task_id="sweep_pods", job=job).sweep_links_staging({"run_id": "run-a"}) == []
