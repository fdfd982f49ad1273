"""The ONE place a site job's pod manifest is built (and, for several nodes, its headless Service).

:func:`build_pod`: the trainer as an exact argv, the Client API's ``FLARE_*`` environment (store
paths rewritten to the store mount), the site's plain env and Secret *references*
(``valueFrom.secretKeyRef``; a value never appears in the pod), cpu / memory / ``nvidia.com/gpu``
with request = limit, volumes, a restrictive ``securityContext`` with a read-only root filesystem
and a scratch ``emptyDir`` at /tmp. Of the model store the pod mounts only the directory of its
input global model (read-only) and the directory of its output (read-write); host paths must lie
under the site admin's allow-list (:mod:`.storage`). :func:`job_pod` does the same from a validated
job (argv from :func:`~flare_airflow.launchers.trainer.trainer_argv`).
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kubernetes import client as k8s

from flare_airflow.core.config import (
    SCRATCH_PATH,
    SCRATCH_VOLUME,
    STORE_VOLUME,
    JobConfig,
    KubernetesLaunchSpec,
    ResourceSpec,
)
from flare_airflow.core.envvars import STORE_PATH_VARS
from flare_airflow.core.spec import SiteJob
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.kubernetes.naming import (
    CONTAINER_NAME,
    RUN_ID_ANNOTATION,
    group_name,
    node_labels,
    node_pod_name,
    pod_labels,
    pod_name,
)
from flare_airflow.launchers.kubernetes.storage import (
    check_host_paths,
    needed_store_paths,
    store_path_in_pod,
    unreachable_store,
)
from flare_airflow.launchers.trainer import trainer_argv

GPU_RESOURCE = "nvidia.com/gpu"
# The site trainer image (docker/Dockerfile.trainer) runs as this user; the pod insists on it.
RUN_AS_USER = 1000


def _literal(value: str) -> str:
    # The kubelet expands $(VAR) in command, args and env values; '$$' is its escape for '$'.
    return value.replace("$", "$$")


def _cpu(cores: float) -> str:
    milli = max(1, round(cores * 1000))
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _resources(resources: ResourceSpec) -> k8s.V1ResourceRequirements | None:
    amounts: dict[str, str] = {}
    if resources.num_of_cpus is not None:
        amounts["cpu"] = _cpu(resources.num_of_cpus)
    if resources.memory is not None:
        amounts["memory"] = resources.memory
    if resources.num_of_gpus:
        amounts[GPU_RESOURCE] = str(resources.num_of_gpus)
    if not amounts:
        return None
    # request = limit: the scheduler reserves exactly what the job may use (Guaranteed QoS with cpu+memory).
    return k8s.V1ResourceRequirements(requests=dict(amounts), limits=dict(amounts))


def _env(
    site_job: SiteJob, spec: KubernetesLaunchSpec, store_root: str | None, distributed: Mapping[str, str]
) -> list[k8s.V1EnvVar]:
    problem = unreachable_store(spec, store_root)
    if problem is not None:
        raise LaunchError(f"{site_job.label}: {problem}")
    # HOME on the scratch volume: the root filesystem is read-only, and libraries write caches there.
    plain: dict[str, str] = {"PYTHONUNBUFFERED": "1", "HOME": SCRATCH_PATH}
    for name, value in site_job.env.items():
        if spec.store_mount is not None and name in STORE_PATH_VARS:
            if store_root is None:
                raise LaunchError(f"{site_job.label}: store_mount is set but no store root was given to build_pod")
            try:
                value = store_path_in_pod(value, store_root, spec.store_mount.mount_path)
            except LaunchError as exc:
                raise LaunchError(f"{site_job.label}: {name}: {exc}") from None
        plain[name] = value
    plain.update(spec.env)
    plain.update(distributed)
    env = [
        k8s.V1EnvVar(name=name, value=_literal(value)) for name, value in plain.items() if name not in spec.secret_env
    ]
    env.extend(
        k8s.V1EnvVar(
            name=name,
            value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(name=ref.secret, key=ref.key)),
        )
        for name, ref in spec.secret_env.items()
    )
    return env


def _volumes(
    spec: KubernetesLaunchSpec, store_paths: Mapping[str, bool]
) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    volumes: list[k8s.V1Volume] = []
    mounts: list[k8s.V1VolumeMount] = []

    def add(name: str, pvc: str | None, host_path: str | None) -> None:
        if pvc is not None:
            source = {"persistent_volume_claim": k8s.V1PersistentVolumeClaimVolumeSource(claim_name=pvc)}
        elif host_path is not None:
            # "Directory": a missing path is a mount error, not a fresh empty directory on some node.
            source = {"host_path": k8s.V1HostPathVolumeSource(path=host_path, type="Directory")}
        else:
            source = {"empty_dir": k8s.V1EmptyDirVolumeSource()}
        volumes.append(k8s.V1Volume(name=name, **source))

    def mount(name: str, mount_path: str, read_only: bool, sub_path: str | None = None) -> None:
        mounts.append(
            k8s.V1VolumeMount(name=name, mount_path=mount_path, read_only=read_only or None, sub_path=sub_path or None)
        )

    add(SCRATCH_VOLUME, None, None)
    mount(SCRATCH_VOLUME, SCRATCH_PATH, False)
    store = spec.store_mount
    if store is not None and store_paths:
        add(STORE_VOLUME, store.pvc, store.host_path)
        # Each path at its usual place under mount_path (so FLARE_* paths are as without
        # subPaths), a parent before anything mounted inside it.
        for path in sorted(store_paths, key=len):
            mount_path = posixpath.join(store.mount_path, path).rstrip("/") or "/"
            mount(STORE_VOLUME, mount_path, store_paths[path], path)
    for vol in spec.volumes:
        add(vol.name, vol.pvc, vol.host_path)
        mount(vol.name, vol.mount_path, vol.read_only)
    return volumes, mounts


def _distributed_env(spec: KubernetesLaunchSpec, group: str, node_rank: int) -> dict[str, str]:
    """torchrun's variables for the pod of ``node_rank`` (one process per pod: RANK = NODE_RANK)."""
    return {
        "RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(spec.nodes),
        "LOCAL_WORLD_SIZE": "1",
        # Rank 0's DNS name through the headless Service (<hostname>.<subdomain>, found through the
        # pod's DNS search path in its namespace).
        "MASTER_ADDR": f"{node_pod_name(group, 0)}.{group}",
        "MASTER_PORT": str(spec.master_port),
    }


def _spread(identity: Mapping[str, str]) -> k8s.V1Affinity:
    # One pod per node where the cluster has enough of them; preferred, not required, so that a
    # site whose nodes are fewer (or one big node) still runs the job.
    return k8s.V1Affinity(
        pod_anti_affinity=k8s.V1PodAntiAffinity(
            preferred_during_scheduling_ignored_during_execution=[
                k8s.V1WeightedPodAffinityTerm(
                    weight=100,
                    pod_affinity_term=k8s.V1PodAffinityTerm(
                        label_selector=k8s.V1LabelSelector(match_labels=dict(identity)),
                        topology_key="kubernetes.io/hostname",
                    ),
                )
            ]
        )
    )


def build_pod(
    site_job: SiteJob,
    spec: KubernetesLaunchSpec,
    resources: ResourceSpec,
    *,
    store_root: str | None,
    try_number: int = 1,
    node_rank: int = 0,
) -> k8s.V1Pod:
    """The pod of one site job (with ``spec.nodes`` > 1: the pod of node ``node_rank`` of it).

    ``site_job.argv`` is the trainer's exact argv inside the image (see :func:`trainer_argv`; it
    becomes the container's ``command``, escaped against the kubelet's ``$(VAR)`` expansion);
    ``site_job.env`` holds the Client API's ``FLARE_*`` variables as the Airflow side computed them.
    With ``spec.store_mount``, ``FLARE_GLOBAL_MODEL`` and ``FLARE_OUTPUT`` must lie under
    ``store_root`` and are rewritten to the mount path; the pod mounts (``subPath``) only the
    directory of the first, read-only, and the directory of the second, read-write, each at its
    place under the mount path. Raises :class:`LaunchError` when the site job cannot run as a pod
    (no image, a store path the pod cannot reach, empty argv, a host path outside
    :func:`allowed_host_paths`).

    A multi-node pod is named ``<group>-n<rank>`` (:func:`~.naming.group_name`), has that name as
    its ``hostname`` and the group's headless Service (:func:`build_service`) as its
    ``subdomain``, carries a ``flare-airflow/node-rank`` label, torchrun's variables (``RANK`` =
    ``NODE_RANK`` = the node rank, ``LOCAL_RANK`` 0, ``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` x nodes,
    ``MASTER_ADDR`` = rank 0's DNS name, ``MASTER_PORT``) and a preferred anti-affinity that
    spreads the group over nodes. ``resources`` are per pod.
    """
    if not spec.image:
        raise LaunchError(f"{site_job.label}: launcher_spec.k8s.image is not set; a pod needs the site's trainer image")
    if not site_job.argv:
        raise LaunchError(f"{site_job.label}: empty argv")
    if not 0 <= node_rank < spec.nodes:
        raise LaunchError(f"{site_job.label}: node rank {node_rank} is outside 0..{spec.nodes - 1} (nodes)")
    check_host_paths(site_job, spec)
    identity = pod_labels(site_job.job, site_job.run_id, site_job.round, site_job.site, try_number)
    distributed: dict[str, str] = {}
    hostname = subdomain = None
    affinity = None
    if spec.nodes > 1:
        group = group_name(site_job.job, site_job.site, site_job.round, site_job.run_id, try_number, spec.nodes)
        name = hostname = node_pod_name(group, node_rank)
        subdomain = group
        labels = {**spec.labels, **node_labels(identity, node_rank)}
        distributed = _distributed_env(spec, group, node_rank)
        affinity = _spread(identity)
    else:
        name = pod_name(site_job.job, site_job.site, site_job.round, site_job.run_id, try_number)
        labels = {**spec.labels, **identity}
    annotations = {**spec.annotations, RUN_ID_ANNOTATION: site_job.run_id}
    env = _env(site_job, spec, store_root, distributed)
    volumes, mounts = _volumes(spec, needed_store_paths(site_job, spec, store_root))
    container = k8s.V1Container(
        name=CONTAINER_NAME,
        image=spec.image,
        image_pull_policy=spec.image_pull_policy,
        command=[_literal(arg) for arg in site_job.argv],
        env=env,
        resources=_resources(resources),
        volume_mounts=mounts or None,
        security_context=k8s.V1SecurityContext(
            allow_privilege_escalation=False,
            capabilities=k8s.V1Capabilities(drop=["ALL"]),
            privileged=False,
            read_only_root_filesystem=True,
            run_as_non_root=True,
        ),
    )
    pod_spec = k8s.V1PodSpec(
        restart_policy="Never",
        containers=[container],
        volumes=volumes or None,
        service_account_name=spec.service_account_name,
        # Trainers do not talk to the Kubernetes API: no token unless the site asks for an account.
        automount_service_account_token=spec.service_account_name is not None,
        image_pull_secrets=[k8s.V1LocalObjectReference(name=s) for s in spec.image_pull_secrets] or None,
        node_selector=dict(spec.node_selector) or None,
        tolerations=[_toleration(t) for t in spec.tolerations] or None,
        termination_grace_period_seconds=math.ceil(site_job.shutdown_timeout),
        hostname=hostname,
        subdomain=subdomain,
        affinity=affinity,
        security_context=k8s.V1PodSecurityContext(
            run_as_non_root=True,
            run_as_user=RUN_AS_USER,
            run_as_group=RUN_AS_USER,
            fs_group=RUN_AS_USER,
            seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
        ),
    )
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(name=name, namespace=spec.namespace, labels=labels, annotations=annotations),
        spec=pod_spec,
    )


def build_service(site_job: SiteJob, spec: KubernetesLaunchSpec, *, try_number: int = 1) -> k8s.V1Service | None:
    """The headless Service of a multi-node site job (``None`` for one pod): named
    :func:`~.naming.group_name`, labelled and selecting by the site job's identity (this try's
    pods only), publishing addresses of pods not yet ready so that rank 0's name resolves as soon
    as its pod has an address."""
    if spec.nodes <= 1:
        return None
    identity = pod_labels(site_job.job, site_job.run_id, site_job.round, site_job.site, try_number)
    name = group_name(site_job.job, site_job.site, site_job.round, site_job.run_id, try_number, spec.nodes)
    return k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=k8s.V1ObjectMeta(
            name=name,
            namespace=spec.namespace,
            labels={**spec.labels, **identity},
            annotations={**spec.annotations, RUN_ID_ANNOTATION: site_job.run_id},
        ),
        spec=k8s.V1ServiceSpec(
            cluster_ip="None",
            selector=dict(identity),
            publish_not_ready_addresses=True,
            ports=[k8s.V1ServicePort(name="rendezvous", port=spec.master_port, protocol="TCP")],
        ),
    )


@dataclass(frozen=True)
class SiteJobObjects:
    """What one try of one site job creates: its pods (rank order) and, for several nodes, the Service."""

    pods: tuple[k8s.V1Pod, ...]
    service: k8s.V1Service | None


def build_site_job(
    site_job: SiteJob,
    spec: KubernetesLaunchSpec,
    resources: ResourceSpec,
    *,
    store_root: str | None,
    try_number: int = 1,
) -> SiteJobObjects:
    """Every object of one site job: :func:`build_pod` for each node rank and :func:`build_service`."""
    pods = tuple(
        build_pod(site_job, spec, resources, store_root=store_root, try_number=try_number, node_rank=rank)
        for rank in range(spec.nodes)
    )
    return SiteJobObjects(pods, build_service(site_job, spec, try_number=try_number))


def _toleration(item: Mapping[str, Any]) -> k8s.V1Toleration:
    return k8s.V1Toleration(
        key=item.get("key"),
        operator=item.get("operator"),
        value=item.get("value"),
        effect=item.get("effect"),
        toleration_seconds=item.get("tolerationSeconds"),
    )


def job_pod(
    job: JobConfig, site: str, site_job: SiteJob, *, store_root: str | None, try_number: int = 1, node_rank: int = 0
) -> k8s.V1Pod:
    """:func:`build_pod` for ``site`` of a validated job: the site's k8s block and resources, and the
    trainer's argv in the image (:func:`trainer_argv`) in place of ``site_job.argv``."""
    site_spec = job.sites[site]
    spec = site_spec.launcher_spec.k8s
    pod_job = replace(site_job, argv=tuple(trainer_argv(job, spec)))
    return build_pod(
        pod_job, spec, site_spec.resource_spec, store_root=store_root, try_number=try_number, node_rank=node_rank
    )


def job_site_job(
    job: JobConfig, site: str, site_job: SiteJob, *, store_root: str | None, try_number: int = 1
) -> SiteJobObjects:
    """:func:`build_site_job` for ``site`` of a validated job (every pod and the Service), as :func:`job_pod`."""
    site_spec = job.sites[site]
    spec = site_spec.launcher_spec.k8s
    pod_job = replace(site_job, argv=tuple(trainer_argv(job, spec)))
    return build_site_job(pod_job, spec, site_spec.resource_spec, store_root=store_root, try_number=try_number)


_SERIALIZER: k8s.ApiClient | None = None


def pod_to_dict(pod: k8s.V1Pod | k8s.V1Service) -> dict[str, Any]:
    """The pod (or Service) as the JSON the API receives (camelCase keys, no ``None`` fields)."""
    global _SERIALIZER
    if _SERIALIZER is None:
        _SERIALIZER = k8s.ApiClient()
    result: dict[str, Any] = _SERIALIZER.sanitize_for_serialization(pod)
    return result
