"""Shared builders for the Kubernetes backend's unit tests: site jobs, site specs, pods as the API returns them."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes_validate
from kubernetes import client as k8s

from flare_airflow.core.config import KubernetesLaunchSpec, ResourceSpec
from flare_airflow.core.spec import JobReturnCode, SiteJob
from flare_airflow.launchers.kubernetes import (
    CONTAINER_NAME,
    build_pod,
    map_pod,
    pod_to_dict,
)

RC = JobReturnCode


RFC1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


SCHEMA_VERSION = kubernetes_validate.latest_version()


STORE = "/srv/flare/store"


def site_job(**kw: Any) -> SiteJob:
    base: dict[str, Any] = {
        "job": "digits",
        "run_id": "manual__2025-05-01T10:00:00+00:00",
        "round": 3,
        "site": "site-1",
        "argv": ("python", "/opt/trainer/train.py", "--epochs", "2"),
        "env": {
            "FLARE_JOB": "digits",
            "FLARE_SITE": "site-1",
            "FLARE_ROUND": "3",
            "FLARE_GLOBAL_MODEL": f"file://{STORE}/digits/run/round-0002/global.safetensors",
            "FLARE_OUTPUT": f"{STORE}/digits/run/round-0003/sites/site-1.safetensors",
            "FLARE_HPARAMS": '{"lr": 0.1}',
        },
        "shutdown_timeout": 7.5,
    }
    base.update(kw)
    return SiteJob(**base)


SPECS: dict[str, dict[str, Any]] = {
    "minimal": {"image": "registry.example.org/fl/trainer:1"},
    "gpu": {
        "image": "registry.example.org/fl/trainer:1",
        "namespace": "fl-site-1",
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "volumes": {
        "image": "registry.example.org/fl/trainer@sha256:" + "a" * 64,
        "volumes": [
            {"name": "data", "mount_path": "/data", "pvc": "site-data", "read_only": True},
            {"name": "reference", "mount_path": "/reference", "host_path": "/srv/reference"},
            {"name": "scratch", "mount_path": "/scratch", "empty_dir": True},
        ],
        "store_mount": {"pvc": "flare-store"},
    },
    "secrets": {
        "image": "trainer:dev",
        "image_pull_policy": "Never",
        "image_pull_secrets": ["regcred"],
        "service_account_name": "fl-trainer",
        "env": {"OMP_NUM_THREADS": "4", "PRICE": "$(NOT_EXPANDED)"},
        "secret_env": {"HF_TOKEN": {"secret": "hf", "key": "token"}, "DB_PASSWORD": {"secret": "db", "key": "pw"}},
        "store_mount": {"host_path": STORE, "mount_path": "/mnt/store"},
    },
    "tolerations": {
        "image": "trainer:1",
        "tolerations": [
            {"operator": "Exists"},
            {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute", "tolerationSeconds": 30},
        ],
        "labels": {"team": "radiology", "example.org/cost-center": "fl-42"},
        "annotations": {"example.org/owner": "site admins <admins@example.org>"},
    },
}


RESOURCES = {
    "minimal": ResourceSpec(),
    "gpu": ResourceSpec(num_of_gpus=2, num_of_cpus=4, memory="16Gi"),
    "volumes": ResourceSpec(num_of_cpus=0.5, memory="512Mi"),
    "secrets": ResourceSpec(num_of_gpus=1),
    "tolerations": ResourceSpec(num_of_cpus=1.25),
}


def built(name: str, try_number: int = 1, **kw: Any) -> dict[str, Any]:
    spec = KubernetesLaunchSpec(**SPECS[name])
    # Sites without a store mount reach an object store (never the local STORE path).
    root = STORE if spec.store_mount is not None else "s3://flare-bucket/store"
    pod = build_pod(site_job(**kw), spec, RESOURCES[name], store_root=root, try_number=try_number)
    return pod_to_dict(pod)


NOW = datetime(2025, 5, 1, 12, 0, 0, tzinfo=UTC)


def pod(
    phase: str | None = "Pending",
    *,
    age: float = 1.0,
    waiting: tuple[str, str] | None = None,
    running: bool = False,
    terminated: dict[str, Any] | None = None,
    last_terminated: dict[str, Any] | None = None,
    scheduled: tuple[str, str, str] | None = None,
    deleting: bool = False,
    reason: str | None = None,
    message: str | None = None,
    volumes: tuple[k8s.V1Volume, ...] = (),
    uid: str = "uid-1",
) -> k8s.V1Pod:
    state = k8s.V1ContainerState(
        waiting=k8s.V1ContainerStateWaiting(reason=waiting[0], message=waiting[1] or None) if waiting else None,
        running=k8s.V1ContainerStateRunning(started_at=NOW) if running else None,
        terminated=k8s.V1ContainerStateTerminated(**terminated) if terminated else None,
    )
    last = k8s.V1ContainerState(
        terminated=k8s.V1ContainerStateTerminated(**last_terminated) if last_terminated else None
    )
    statuses = None
    if waiting or running or terminated or last_terminated:
        statuses = [
            k8s.V1ContainerStatus(
                name=CONTAINER_NAME,
                image="x",
                image_id="",
                ready=running,
                restart_count=0,
                state=state,
                last_state=last,
            )
        ]
    conditions = None
    if scheduled:
        conditions = [
            k8s.V1PodCondition(type="PodScheduled", status=scheduled[0], reason=scheduled[1], message=scheduled[2])
        ]
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name="p",
            uid=uid,
            creation_timestamp=NOW - timedelta(seconds=age),
            deletion_timestamp=NOW if deleting else None,
        ),
        spec=k8s.V1PodSpec(containers=[k8s.V1Container(name=CONTAINER_NAME)], volumes=list(volumes) or None),
        status=k8s.V1PodStatus(
            phase=phase, container_statuses=statuses, conditions=conditions, reason=reason, message=message
        ),
    )


def mapped(p: k8s.V1Pod | None, events: tuple[Any, ...] = (), **kw: float):
    return map_pod(
        p, now=NOW, pending_timeout=kw.get("pending", 300), startup_timeout=kw.get("startup", 120), events=events
    )


RUNNING = {"running": k8s.V1ContainerStateRunning(started_at=NOW)}


DONE = {"terminated": k8s.V1ContainerStateTerminated(exit_code=0, reason="Completed")}


def _mounts(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod["spec"]["containers"][0]["volumeMounts"])


def _env_values(pod: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def _staging_job(round_num: int = 3, try_number: int = 2) -> SiteJob:
    # The layout with per-try staging directories: the input global model of round r-1, the update
    # of this site and try under round r.
    run = f"{STORE}/digits/run"
    return site_job(
        round=round_num,
        env={
            "FLARE_SITE": "site-1",
            "FLARE_GLOBAL_MODEL": f"file://{run}/round-{round_num - 1:04d}/global.safetensors",
            "FLARE_OUTPUT": f"{run}/round-{round_num:04d}/staging/site-1/try-{try_number}/update.safetensors",
        },
    )
