"""Multi-node Kubernetes site jobs (``nodes: N``): one pod per node and a headless Service from the
one manifest builder, validated strictly against the Kubernetes schemas; the group's state table;
pool slots; what the k8s block refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client as k8s
from pydantic import ValidationError

from flare_airflow.core.config import KubernetesLaunchSpec, ResourceSpec
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.pools import required_pools
from flare_airflow.core.spec import JobIdentity, JobState
from flare_airflow.launchers.kubernetes import (
    NODE_RANK_LABEL,
    build_pod,
    build_site_job,
    group_name,
    map_pod_group,
    pod_labels,
    pod_to_dict,
    site_job_selector,
    site_pods_selector,
)
from flare_airflow.launchers.process import LaunchError
from tests.unit.airflow_layer import make_job
from tests.unit.launchers.kubernetes.pods import (
    NOW,
    RC,
    RFC1123,
    SCHEMA_VERSION,
    SPECS,
    STORE,
    _env_values,
    pod,
    site_job,
)

RFC1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def objects(nodes: int = 2, name: str = "gpu", try_number: int = 1, **spec: Any) -> tuple[list[dict], dict]:
    k8s_spec = KubernetesLaunchSpec(**{**SPECS[name], "nodes": nodes, **spec})
    root = STORE if k8s_spec.store_mount is not None else "s3://flare-bucket/store"
    built = build_site_job(site_job(), k8s_spec, ResourceSpec(num_of_gpus=2), store_root=root, try_number=try_number)
    assert built.service is not None
    return [pod_to_dict(p) for p in built.pods], pod_to_dict(built.service)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_pod_and_the_service_validate_strictly(name: str) -> None:
    pods, service = objects(3, name)
    for manifest in [*pods, service]:
        kubernetes_validate.validate(manifest, SCHEMA_VERSION, strict=True)
    broken = json.loads(json.dumps(service))
    broken["spec"]["clusterIp"] = "None"  # the field is clusterIP: a typo is refused
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSION, strict=True)


def test_pods_find_rank_0_through_the_headless_service() -> None:
    pods, service = objects(3)
    group = service["metadata"]["name"]
    assert [p["metadata"]["name"] for p in pods] == [f"{group}-n0", f"{group}-n1", f"{group}-n2"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"] == [{"name": "rendezvous", "port": 29500, "protocol": "TCP"}]
    for rank, p in enumerate(pods):
        assert p["spec"]["hostname"] == p["metadata"]["name"] and p["spec"]["subdomain"] == group
        env = _env_values(p)
        assert {k: env[k] for k in ("RANK", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
            "RANK": str(rank),
            "NODE_RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "1",
        }
        assert env["MASTER_ADDR"] == f"{group}-n0.{group}" and env["MASTER_PORT"] == "29500"
        # The Service selects exactly this pod's identity (every label it selects on, the pod has).
        assert service["spec"]["selector"].items() <= p["metadata"]["labels"].items()
        assert p["metadata"]["labels"][NODE_RANK_LABEL] == str(rank)
        # resources are per pod
        assert p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        term = p["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == service["spec"]["selector"]


def test_one_site_job_one_identity_every_try_its_own_group() -> None:
    pods, service = objects(2)
    later_pods, later_service = objects(2, try_number=2)
    identity = pod_labels("digits", site_job().run_id, 3, "site-1", 1)
    assert service["metadata"]["labels"].items() >= identity.items()
    assert service["spec"]["selector"] == identity
    # Every pod of every try of the site job shares the identity labels but the try's.
    site = dict(item.split("=") for item in site_pods_selector("digits", site_job().run_id, 3, "site-1").split(","))
    for p in [*pods, *later_pods, service, later_service]:
        assert site.items() <= p["metadata"]["labels"].items()
    assert later_service["metadata"]["name"] != service["metadata"]["name"]
    assert not set(later_service["spec"]["selector"].items()) <= set(pods[0]["metadata"]["labels"].items())
    selected = dict(
        item.split("=")
        for item in site_job_selector(JobIdentity("digits", site_job().run_id, 3, "site-1", 1)).split(",")
    )
    assert selected == identity  # what finds a launch again selects exactly the Service's pods


def test_names_fit_63_characters_and_dns_rules_with_many_nodes() -> None:
    job = site_job(job="a-very-long-federated-job-name-" * 3, site="hospital-" * 8)
    spec = KubernetesLaunchSpec(image="trainer:1", nodes=1024)
    group = group_name(job.job, job.site, job.round, job.run_id, 1, 1024)
    assert len(group) <= 63 and re.match(RFC1035, group)
    last = build_pod(job, spec, ResourceSpec(), store_root="s3://b/s", node_rank=1023)
    assert last.metadata.name == f"{group}-n1023" and len(last.metadata.name) <= 63
    assert RFC1123.match(last.metadata.name)
    assert len(f"{last.metadata.name}.{group}") <= 253


def test_one_node_is_one_pod_as_before() -> None:
    single = build_site_job(site_job(), KubernetesLaunchSpec(image="trainer:1"), ResourceSpec(), store_root="s3://b")
    assert single.service is None and len(single.pods) == 1
    p = pod_to_dict(single.pods[0])
    assert "RANK" not in _env_values(p) and "hostname" not in p["spec"] and "affinity" not in p["spec"]
    assert NODE_RANK_LABEL not in p["metadata"]["labels"]


def test_a_node_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(LaunchError, match=r"node rank 2 is outside 0\.\.1"):
        build_pod(
            site_job(), KubernetesLaunchSpec(image="t:1", nodes=2), ResourceSpec(), store_root="s3://b", node_rank=2
        )


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"nodes": 0}, "greater than or equal to 1"),
        ({"nodes": 1025}, "less than or equal to 1024"),
        ({"master_port": 80}, "greater than or equal to 1024"),
        ({"env": {"MASTER_ADDR": "x"}}, "MASTER_ADDR is set by flare-airflow for each pod"),
        ({"secret_env": {"RANK": {"secret": "s", "key": "k"}}}, "RANK is set by flare-airflow"),
    ],
)
def test_the_k8s_block_refuses(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        KubernetesLaunchSpec(image="t:1", **block)


def _job(tmp_path: Path, nodes: int, gpus: int, capacity: int) -> Any:
    site = {
        "launcher": "k8s",
        "launcher_spec": {"k8s": {"image": "t:1", "nodes": nodes, "store_mount": {"pvc": "s"}}},
        "resource_spec": {"num_of_gpus": gpus},
        "resource_manager": {"type": "gpu", "num_of_gpus": capacity},
    }
    return make_job(tmp_path, min_clients=1, sites={"site-1": site})


def test_pool_slots_are_gpus_per_pod_times_nodes(tmp_path: Path) -> None:
    job = _job(tmp_path, nodes=3, gpus=2, capacity=8)
    assert job.sites["site-1"].gpus_per_job == 6
    assert required_pools(job)["flare_gpu_site-1"].largest_request == 6
    with pytest.raises(ConfigError, match=r"asks for 6 GPUs \(2 per node x 3 nodes\) but the site has only 4"):
        _job(tmp_path, nodes=3, gpus=2, capacity=4)


def _named(*pods: k8s.V1Pod | None) -> list[tuple[str, k8s.V1Pod | None]]:
    return [(f"g-n{rank}", p) for rank, p in enumerate(pods)]


def _group(*pods: k8s.V1Pod | None, pending: float = 300, startup: float = 120):
    return map_pod_group(_named(*pods), now=NOW, pending_timeout=pending, startup_timeout=startup)


def _terminated(code: int, reason: str = "Error") -> dict[str, Any]:
    return {"exit_code": code, "reason": reason}


def test_the_group_fails_when_one_pod_fails_naming_it() -> None:
    killed = pod("Failed", terminated=_terminated(137))
    group = _group(pod("Running", running=True), killed)
    assert group.status.done and group.pod == "g-n1" and group.status.return_code is RC.EXECUTION_ERROR
    assert group.status.reason.startswith("node rank 1 of 2 (pod g-n1): ")
    assert "137" in group.status.reason


def test_a_vanished_pod_fails_the_group_even_when_the_others_succeed() -> None:
    done = pod("Succeeded", terminated=_terminated(0, "Completed"))
    group = _group(done, None)
    assert group.status.done and group.status.return_code is RC.INFRASTRUCTURE_ERROR and group.pod == "g-n1"


def test_the_group_succeeds_only_when_every_pod_did() -> None:
    done = pod("Succeeded", terminated=_terminated(0, "Completed"))
    half = _group(done, pod("Running", running=True))
    assert not half.status.done and half.status.state is JobState.RUNNING
    full = _group(done, done)
    assert full.status.done and full.status.state is JobState.SUCCEEDED and full.pod == "g-n0"


def test_the_group_waits_for_resources_while_one_pod_does_and_then_times_out() -> None:
    scheduled = ("False", "Unschedulable", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    waiting = pod("Pending", scheduled=scheduled, age=10)
    group = _group(pod("Running", running=True), waiting)
    assert group.status.waiting_for_resources and not group.status.done and group.pod == "g-n1"
    late = pod("Pending", scheduled=scheduled, age=400)
    timed_out = _group(pod("Running", running=True), late)
    assert timed_out.status.done and "pending_timeout" in timed_out.status.reason and timed_out.pod == "g-n1"


def test_one_pod_is_map_pod() -> None:
    p = pod("Running", running=True)
    assert _group(p).status.state is JobState.RUNNING and _group(p).pod == "g-n0"
    assert not _group(pod("Pending", age=1)).status.done
    assert _group(pod("Pending", age=121)).status.done
