"""Backends this version lacks (NVFlare's docker and slurm) are refused wherever a job names them."""

from __future__ import annotations

import pytest

from flare_airflow.core.errors import ConfigError
from tests.unit.airflow_layer import make_job


@pytest.mark.parametrize("backend", ["slurm", "docker"])
def test_a_launcher_spec_block_of_a_missing_backend_is_refused(tmp_path, backend) -> None:
    with pytest.raises(ConfigError) as info:
        make_job(tmp_path, sites={"site-1": {"launcher_spec": {backend: {"partition": "gpu"}}}, "site-2": {}})
    assert (
        f"sites.site-1.launcher_spec.{backend}: the backend {backend!r} is not available in this version "
        "of flare-airflow; supported: process, k8s"
    ) in str(info.value)


def test_kubernetes_is_an_alias_of_k8s(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": {"launcher_spec": {"kubernetes": {"namespace": "fl"}}}, "site-2": {}})
    assert job.sites["site-1"].launcher_spec.k8s.namespace == "fl"
