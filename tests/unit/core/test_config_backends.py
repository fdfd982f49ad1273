"""Backends this version lacks (NVFlare's docker) are refused wherever a job names them."""

from __future__ import annotations

import pytest

from flare_airflow.core.errors import ConfigError
from tests.unit.airflow_layer import make_job


def test_a_launcher_spec_block_of_a_missing_backend_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        make_job(tmp_path, sites={"site-1": {"launcher_spec": {"docker": {"image": "x"}}}, "site-2": {}})
    assert (
        "sites.site-1.launcher_spec.docker: the backend 'docker' is not available in this version "
        "of flare-airflow; supported: process, k8s, slurm"
    ) in str(info.value)


def test_kubernetes_is_an_alias_of_k8s(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": {"launcher_spec": {"kubernetes": {"namespace": "fl"}}}, "site-2": {}})
    assert job.sites["site-1"].launcher_spec.k8s.namespace == "fl"
