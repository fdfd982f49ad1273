"""Site policy: the job asks, the site decides (core/config/policy.py)."""

from __future__ import annotations

import pytest

from flare_airflow.core.config import apply_site_policy, load_site_policy, site_policy_from_dict
from flare_airflow.core.errors import ConfigError
from tests.unit.airflow_layer import make_job

ASKING = {
    "resource_spec": {"num_of_gpus": 2},
    "resource_manager": {"type": "gpu", "num_of_gpus": 8},
    "retries": 3,
    "weight": 2.0,
    "launcher_spec": {
        "process": {"cwd": "/etc", "env": {"FROM_JOB": "1"}},
        "k8s": {
            "image": "evil/image:1",
            "volumes": [{"name": "root", "host_path": "/data/all-sites", "mount_path": "/host"}],
        },
    },
}
POLICY = {
    "sites": {
        "site-1": {
            "resource_manager": {"type": "gpu", "num_of_gpus": 2},
            "launcher_spec": {"process": {"env": {"FROM_SITE": "1"}, "cwd": "/tmp"}},
            "store_conn_id": "flare_store",
        }
    }
}


def test_the_site_decides_paths_env_images_and_gpu_limit_the_job_keeps_its_request(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": ASKING, "site-2": {}})
    spec = apply_site_policy(job, "site-1", site_policy_from_dict(POLICY)).sites["site-1"]
    assert spec.launcher_spec.process.env == {"FROM_SITE": "1"}
    assert spec.launcher_spec.process.cwd == "/tmp"
    assert spec.launcher_spec.k8s.image is None and spec.launcher_spec.k8s.volumes == []  # not the job's
    assert spec.resource_manager is not None and spec.resource_manager.num_of_gpus == 2
    assert (spec.resource_spec.num_of_gpus, spec.retries, spec.weight) == (2, 3, 2.0)


def test_other_sites_and_the_job_object_are_untouched(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": ASKING, "site-2": {}})
    apply_site_policy(job, "site-1", site_policy_from_dict(POLICY))
    assert job.sites["site-1"].launcher_spec.process.env == {"FROM_JOB": "1"}


def test_more_gpus_than_the_site_allows_is_refused_naming_the_policy(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": {**ASKING, "resource_spec": {"num_of_gpus": 4}}, "site-2": {}})
    policy = site_policy_from_dict(POLICY, source="/etc/flare/site.yaml")
    with pytest.raises(ConfigError, match=r"site 'site-1' \(site policy /etc/flare/site.yaml\).*asks for 4 GPUs"):
        apply_site_policy(job, "site-1", policy)


def test_a_task_of_another_site_on_this_worker_is_refused(tmp_path) -> None:
    job = make_job(tmp_path)
    with pytest.raises(ConfigError, match="covers only site-1; a task of site 'site-2' reached a worker"):
        apply_site_policy(job, "site-2", site_policy_from_dict(POLICY))


def test_a_policy_file_is_read_with_the_job_files_reader(tmp_path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text("sites:\n  site-1:\n    launcher_spec: {process: {env: {A: '1'}}}\n")
    assert load_site_policy(path).sites["site-1"].launcher_spec == {"process": {"env": {"A": "1"}}}
    assert load_site_policy(path).source == str(path)


def test_a_policy_spanning_more_nodes_than_the_dag_took_pool_slots_for_is_refused(tmp_path) -> None:
    k8s = {"image": "site/t:1", "store_mount": {"pvc": "store", "mount_path": "/s"}}
    asked = {"launcher": "k8s", "resource_spec": {"num_of_gpus": 1}, "launcher_spec": {"k8s": {"image": "j:1"}}}
    asked["resource_manager"] = {"type": "gpu", "num_of_gpus": 4}
    job = make_job(tmp_path, sites={"site-1": asked, "site-2": {}})
    entry = {"launcher": "k8s", "resource_manager": {"type": "gpu", "num_of_gpus": 4}}
    policy = site_policy_from_dict({"sites": {"site-1": {**entry, "launcher_spec": {"k8s": {**k8s, "nodes": 2}}}}})
    with pytest.raises(
        ConfigError, match=r"2 node\(s\) x 1 GPU\(s\) = 2 GPU\(s\), but this job's DAG took 1 pool slot"
    ):
        apply_site_policy(job, "site-1", policy)
    same = site_policy_from_dict({"sites": {"site-1": {**entry, "launcher_spec": {"k8s": k8s}}}})
    assert apply_site_policy(job, "site-1", same).sites["site-1"].launcher_spec.k8s.image == "site/t:1"
