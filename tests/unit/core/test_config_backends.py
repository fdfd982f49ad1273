"""NVFlare's backend names (kubernetes, docker) are aliases of this version's blocks."""

from __future__ import annotations

import pytest

from flare_airflow.core.errors import ConfigError
from tests.unit.airflow_layer import make_job


def test_nvflares_docker_block_is_the_container_block(tmp_path) -> None:
    sites = {"site-1": {"launcher": "docker", "launcher_spec": {"docker": {"image": "x"}}}, "site-2": {}}
    job = make_job(tmp_path, sites=sites)
    assert (job.sites["site-1"].launcher, job.sites["site-1"].launcher_spec.container.image) == ("container", "x")


def test_an_nvflare_docker_key_this_block_lacks_is_named(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        make_job(tmp_path, sites={"site-1": {"launcher_spec": {"docker": {"docker_image": "x"}}}, "site-2": {}})
    assert "launcher_spec.container.docker_image" in str(info.value)


def test_kubernetes_is_an_alias_of_k8s(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": {"launcher_spec": {"kubernetes": {"namespace": "fl"}}}, "site-2": {}})
    assert job.sites["site-1"].launcher_spec.k8s.namespace == "fl"
