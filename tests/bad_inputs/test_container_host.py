"""Bad-input battery, category "container": what a job file may not take from a container site's
host (issue 35). Without a site policy the job file's ``launcher_spec.container`` is all there is,
so it may pass only GPUs, grant no host directory and name no privileged group; the site policy
(the site admin's) may do more, but never mount the model store or AIRFLOW_HOME.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import yaml

from flare_airflow.core.config import apply_site_policy, load_job, load_site_policy
from flare_airflow.core.errors import ConfigError
from tests.bad_inputs.cases import Case, assert_clear
from tests.bad_inputs.test_container import BASE, MAX_MESSAGE, Bad, _job

JOB_FILE_CASES = [
    Case("container-job-device-disk", "container", "a job file's gpu_devices names the host's disk /dev/vda",
         "gpu device '/dev/vda' is not a GPU: a job file may pass only GPUs"),
    Case("container-job-device-mem", "container", "a job file's gpu_devices names /dev/mem",
         "gpu device '/dev/mem' is not a GPU"),
    Case("container-job-device-kvm-rwm", "container", "a job file's gpu_devices names /dev/kvm:rwm",
         "gpu device '/dev/kvm:rwm' is not a GPU"),
    Case("container-job-device-gpu-with-perms", "container", "a job file's gpu_devices names /dev/nvidia0:rwm",
         "no ':rwm' suffix"),
    Case("container-job-grants-host-paths", "container",
         "a job file grants itself allowed_host_paths [/srv] and mounts /srv/data",
         "allowed_host_paths is the site admin's, not the job's: a job file cannot grant host directories"),
    Case("container-job-volume-root", "container", "a job file mounts the host's / (with allowed_host_paths [/])",
         "would expose the node's root to the trainer"),
    Case("container-job-group-disk", "container", 'a job file runs the trainer as user "1000:6" (group disk)',
         "gid 6 is the host's group 'disk', which reaches the host past the container; a job file may not name it"),
    Case("container-job-group-shadow", "container", 'user "1000:42" (group shadow)',
         "gid 42 is the host's group 'shadow'"),
    Case("container-uid-overflow", "container", 'user "4294967295:1000" ((uid_t)-1)',
         "uid and gid must be at most 4294967294"),
]  # fmt: skip
JOB_FILE_INPUTS = {
    "container-job-device-disk": Bad(container={"gpu_devices": ["/dev/vda"]}),
    "container-job-device-mem": Bad(container={"gpu_devices": ["/dev/mem"]}),
    "container-job-device-kvm-rwm": Bad(container={"gpu_devices": ["/dev/kvm:rwm"]}),
    "container-job-device-gpu-with-perms": Bad(container={"gpu_devices": ["/dev/nvidia0:rwm"]}),
    "container-job-grants-host-paths": Bad(
        container={"allowed_host_paths": ["/srv"], "volumes": [{"host_path": "/srv/data", "mount_path": "/data"}]}
    ),
    "container-job-volume-root": Bad(
        container={"allowed_host_paths": ["/"], "volumes": [{"host_path": "/", "mount_path": "/host"}]}
    ),
    "container-job-group-disk": Bad(container={"user": "1000:6"}),
    "container-job-group-shadow": Bad(container={"user": "1000:42"}),
    "container-uid-overflow": Bad(container={"user": "4294967295:1000"}),
}
POLICY_CASES = [
    Case("container-policy-volume-store-root", "container", "a site policy mounts the job's model store root",
         "would expose the model store ("),
    Case("container-policy-volume-above-store", "container",
         "a site policy mounts a directory holding the model store (read-only)", "would expose the model store ("),
    Case("container-policy-volume-airflow-home", "container", "a site policy mounts AIRFLOW_HOME",
         "would expose AIRFLOW_HOME ("),
]  # fmt: skip
CASES = JOB_FILE_CASES + POLICY_CASES


@pytest.mark.parametrize("bad_case", JOB_FILE_CASES, ids=[c.id for c in JOB_FILE_CASES])
def test_a_job_file_takes_nothing_of_the_host(bad_case: Case, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(JOB_FILE_INPUTS[bad_case.id]), sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_job(path)
    message = str(info.value)
    assert str(path) in message and "sites.site-1" in message and len(message) <= MAX_MESSAGE, message
    assert_clear(bad_case, message)


@pytest.mark.parametrize("gpus", [["nvidia.com/gpu=0", "nvidia.com/gpu=all"], ["/dev/nvidia0", "/dev/dri/renderD128"]])
def test_a_job_file_still_passes_gpus(gpus: list[str], tmp_path: pathlib.Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(Bad(container={"gpu_devices": gpus, "user": "1000:44"})), sort_keys=False))
    assert load_job(path).sites["site-1"].launcher_spec.container.gpu_devices == gpus


def _policy(tmp_path: pathlib.Path, block: dict[str, Any]) -> pathlib.Path:
    path = tmp_path / "site.yaml"
    site = {"launcher": "container", "launcher_spec": {"container": {**BASE, **block}}}
    path.write_text(yaml.safe_dump({"sites": {"site-1": site}}, sort_keys=False))
    return path


def _job_with_store(tmp_path: pathlib.Path, store: pathlib.Path) -> Any:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(Bad(job={"store": str(store)})), sort_keys=False))
    return load_job(path)


@pytest.mark.parametrize("bad_case", POLICY_CASES, ids=[c.id for c in POLICY_CASES])
def test_a_site_policy_never_mounts_the_store_or_airflow_home(
    bad_case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "airflow"
    monkeypatch.setenv("AIRFLOW_HOME", str(home))
    store = tmp_path / "srv" / "store"
    host = {
        "container-policy-volume-store-root": store,
        "container-policy-volume-above-store": store.parent,
        "container-policy-volume-airflow-home": home,
    }[bad_case.id]
    volume = {"host_path": str(host), "mount_path": "/data"}
    path = _policy(tmp_path, {"allowed_host_paths": [str(tmp_path)], "volumes": [volume]})
    with pytest.raises(ConfigError) as info:
        apply_site_policy(_job_with_store(tmp_path, store), "site-1", load_site_policy(path))
    assert_clear(bad_case, str(info.value))
    assert "site 'site-1'" in str(info.value) and str(path) in str(info.value)


def test_the_site_policy_may_grant_what_a_job_file_may_not(tmp_path: pathlib.Path) -> None:
    """The site admin's word: another device, a privileged group, a read-write data directory."""
    data = tmp_path / "data"
    block = {
        "gpu_devices": ["/dev/infiniband/uverbs0"],
        "user": "1000:6",
        "allowed_host_paths": [str(tmp_path)],
        "volumes": [{"host_path": str(data), "mount_path": "/data", "read_only": False}],
    }
    job = apply_site_policy(
        _job_with_store(tmp_path, tmp_path / "store"), "site-1", load_site_policy(_policy(tmp_path, block))
    )
    container = job.sites["site-1"].launcher_spec.container
    assert container.gpu_devices == ["/dev/infiniband/uverbs0"] and container.user == "1000:6"
    assert container.volumes[0].read_only is False
