"""Kubernetes launcher: a site job is one pod. The ONE place a site job's pod manifest is built.

Pieces, all usable without Airflow:

* :func:`pod_name` / :func:`pod_labels` -- the pod's identity: an RFC 1123 name of at most 63
  characters, readable (``fl-<job>-<site>-r<round>-<hash>``) and unique per (run, round, site, try);
  labels for job, run, round, site and try.
* :func:`build_pod` -- the manifest: the trainer as an exact argv, the Client API's ``FLARE_*``
  environment (store paths rewritten to the store mount), the site's plain env and Secret
  *references* (``valueFrom.secretKeyRef``; a value never appears in the pod), cpu / memory /
  ``nvidia.com/gpu`` with request = limit, volumes, a restrictive ``securityContext`` with a
  read-only root filesystem and a scratch ``emptyDir`` at /tmp. Of the model store the pod mounts
  only the directory of its input global model (read-only) and the directory of its output
  (read-write); host paths must lie under the site admin's allow-list
  (:data:`ALLOWED_HOST_PATHS_ENV` on the machine that builds the pod).
  :func:`job_pod` does the same from a validated job (argv from :func:`trainer_argv`).
* :func:`map_pod` -- the one state table of this backend (``docs/state-mapping.md``): a pod (or
  ``None`` when it vanished) to :class:`PodStatus` (state, return code, reason, done, waiting for
  resources), with NVIDIA FLARE's semantics: wait while Pending for lack of cpu / memory / GPUs up
  to ``pending_timeout``, fail fast on image, configuration and mount errors, never success for
  a pod that vanished or is in an unknown phase.
* :class:`KubernetesLauncher` / :class:`KubernetesJobHandle` -- the launcher spec for callers
  outside Airflow (a CLI, an NVFlare-style caller): create the pod, poll it through
  :func:`map_pod` (API reads retried with backoff), delete it when it finishes (unless the site keeps
  pods) or when terminated.

How the Airflow pod operator uses this module (it must not build a manifest of its own)::

    pod = job_pod(job, site, site_job, store_root=str(store_root), try_number=ti.try_number)
    # either: KubernetesPodOperator(full_pod_spec=pod, base_container_name=CONTAINER_NAME, ...)
    # or: override build_pod_request_obj() to return this pod plus the operator's own
    #     identifying labels (self._get_ti_pod_labels(context)), so that re-attaching works.
    # The pod-state trigger calls map_pod(pod_or_None, now=..., pending_timeout=spec.pending_timeout,
    # startup_timeout=spec.startup_timeout) on every read and stops when .done.

Only this module imports ``kubernetes`` (the launchers package does not import it by default).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import posixpath
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import tenacity
import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from flare_airflow.core.config import (
    MANAGED_BY_LABEL,
    RESERVED_LABEL_PREFIX,
    SCRATCH_PATH,
    SCRATCH_VOLUME,
    STORE_VOLUME,
    JobConfig,
    KubernetesLaunchSpec,
    ResourceSpec,
    TrainerSpec,
    path_within,
)
from flare_airflow.core.spec import JobHandleSpec, JobLauncherSpec, JobReturnCode, JobState, LineSink, SiteJob
from flare_airflow.launchers.process import LaunchError, map_exit

log = logging.getLogger(__name__)

__all__ = [
    "ALLOWED_HOST_PATHS_ENV",
    "CONTAINER_NAME",
    "FAIL_FAST_REASONS",
    "GPU_RESOURCE",
    "RUN_AS_USER",
    "STORE_PATH_VARS",
    "KubernetesJobHandle",
    "KubernetesLauncher",
    "PodStatus",
    "allowed_host_paths",
    "build_pod",
    "delete_site_pods",
    "job_pod",
    "map_pod",
    "pod_labels",
    "pod_name",
    "pod_to_dict",
    "site_pods_selector",
    "store_path_in_pod",
    "trainer_argv",
]

CONTAINER_NAME = "trainer"
GPU_RESOURCE = "nvidia.com/gpu"
# The site trainer image (docker/Dockerfile.trainer) runs as this user; the pod insists on it.
RUN_AS_USER = 1000
DEFAULT_TRAINER_COMMAND = ("python",)
# Client API variables that hold store locations (rewritten from the store root to the mount).
STORE_PATH_VARS = ("FLARE_GLOBAL_MODEL", "FLARE_OUTPUT")
RUN_ID_ANNOTATION = f"{RESERVED_LABEL_PREFIX}run-id"
# Site policy on the worker, not in the job file: the host path prefixes pods may mount, ':'-separated.
ALLOWED_HOST_PATHS_ENV = "FLARE_K8S_ALLOWED_HOST_PATHS"

_MAX_NAME = 63
_NAME_PREFIX = "fl"
_HASHED = re.compile(r"-[0-9a-f]{8}$")

# Container waiting reasons that no amount of waiting fixes (the kubelet keeps retrying them, but a
# site job must fail with the reason instead of hanging until a timeout), and their return codes.
FAIL_FAST_REASONS: dict[str, JobReturnCode] = {
    "ErrImagePull": JobReturnCode.INFRASTRUCTURE_ERROR,
    "ImagePullBackOff": JobReturnCode.INFRASTRUCTURE_ERROR,
    "ErrImageNeverPull": JobReturnCode.INFRASTRUCTURE_ERROR,
    "InvalidImageName": JobReturnCode.CONFIG_ERROR,
    "CreateContainerConfigError": JobReturnCode.CONFIG_ERROR,
    "CreateContainerError": JobReturnCode.INFRASTRUCTURE_ERROR,
    "RunContainerError": JobReturnCode.INFRASTRUCTURE_ERROR,
    "CrashLoopBackOff": JobReturnCode.EXECUTION_ERROR,
}
_MOUNT_FAILURE_EVENTS = ("FailedMount", "FailedAttachVolume")
_MOUNT_FAILURE_TEXT = ("MountVolume.SetUp failed", "Unable to attach or mount volumes", "FailedMount")
_INSUFFICIENT = re.compile(r"Insufficient [\w./-]+|Too many pods")
_VANISHED = "pod vanished (deleted or garbage-collected) before reporting a result"


# ----------------------------------------------------------------------------- identity
def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:8]


def _dns_part(value: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")


def pod_name(job: str, site: str, round_num: int, run_id: str, try_number: int) -> str:
    """``fl-<job>-<site>-r<round>-<8 hex>``: RFC 1123, at most 63 characters, stable.

    The hash covers (job, run, round, site, try), so names differ per run and per try while the
    readable part says what the pod is; job and site are shortened when the name would be too long.
    """
    if round_num < 0 or try_number < 0:
        raise ValueError(f"round ({round_num}) and try ({try_number}) must be >= 0")
    tail = f"-r{round_num}-{_digest(job, run_id, round_num, site, try_number)}"
    room = _MAX_NAME - len(_NAME_PREFIX) - len(tail) - 2  # the two '-' around job and site
    job_part, site_part = _dns_part(job), _dns_part(site)
    if len(job_part) + len(site_part) > room:
        # The site says more about a pod than the job (one DAG per job); it keeps at least half.
        site_len = min(len(site_part), max(room // 2, room - len(job_part)))
        job_part = job_part[: room - site_len].strip("-")
        site_part = site_part[:site_len].strip("-")
    return "-".join(p for p in (_NAME_PREFIX, job_part, site_part) if p) + tail


def _label_value(value: str) -> str:
    """``value`` if it is a label value that cannot be mistaken for a shortened one, else a safe form + hash."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", value).strip("._-")
    if cleaned == value and len(value) <= _MAX_NAME and not _HASHED.search(value):
        return value
    short = cleaned[: _MAX_NAME - 9].rstrip("._-")
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    return f"{short}-{digest}" if short else digest


def pod_labels(job: str, run_id: str, round_num: int, site: str, try_number: int) -> dict[str, str]:
    """The labels that identify a site job's pod (select with ``flare-airflow/run=<pod_labels(...)[...]>``)."""
    return {
        MANAGED_BY_LABEL: "flare-airflow",
        f"{RESERVED_LABEL_PREFIX}job": _label_value(job),
        f"{RESERVED_LABEL_PREFIX}run": _label_value(run_id),
        f"{RESERVED_LABEL_PREFIX}round": str(round_num),
        f"{RESERVED_LABEL_PREFIX}site": _label_value(site),
        f"{RESERVED_LABEL_PREFIX}try": str(try_number),
    }


def site_pods_selector(job: str, run_id: str, round_num: int | None = None, site: str | None = None) -> str:
    """Label selector for the pods of a run, or of one site job (round and site) of it, every try."""
    labels = pod_labels(job, run_id, round_num or 0, site or "", 0)
    keys = [MANAGED_BY_LABEL, f"{RESERVED_LABEL_PREFIX}job", f"{RESERVED_LABEL_PREFIX}run"]
    if round_num is not None:
        keys.append(f"{RESERVED_LABEL_PREFIX}round")
    if site is not None:
        keys.append(f"{RESERVED_LABEL_PREFIX}site")
    return ",".join(f"{key}={labels[key]}" for key in keys)


_FINISHED_PHASES = ("Succeeded", "Failed")


def delete_site_pods(
    core: k8s.CoreV1Api,
    namespace: str,
    selector: str,
    *,
    before_try: int | None = None,
    keep_finished: bool = False,
) -> list[str]:
    """Delete, with no grace period, the pods ``selector`` finds in ``namespace``; return their names.

    ``before_try``: only pods of tries below it (a new try supersedes them: they run unwatched,
    their task process is gone). ``keep_finished``: leave pods that already finished (a site that
    keeps pods for debugging); running and pending ones are deleted all the same. API reads and
    deletes are retried on transient errors; a pod that is already gone is not an error.
    """

    def listed() -> list[Any]:
        return list(
            core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=_REQUEST_TIMEOUT).items
        )

    deleted = []
    for pod in _retrying(listed):
        try_label = (pod.metadata.labels or {}).get(f"{RESERVED_LABEL_PREFIX}try", "")
        if before_try is not None and not (try_label.isdigit() and int(try_label) < before_try):
            continue
        phase = pod.status.phase if pod.status is not None else None
        if keep_finished and phase in _FINISHED_PHASES:
            continue

        def delete(name: str = pod.metadata.name, uid: str | None = pod.metadata.uid) -> None:
            try:
                core.delete_namespaced_pod(
                    name,
                    namespace,
                    body=k8s.V1DeleteOptions(grace_period_seconds=0, preconditions=k8s.V1Preconditions(uid=uid)),
                    _request_timeout=_REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status not in (404, 409):  # gone already / another pod under that name now
                    raise

        _retrying(delete)
        deleted.append(f"{pod.metadata.name} (try {try_label or '?'}, {phase or 'unknown phase'})")
    return deleted


# ----------------------------------------------------------------------------- manifest
def trainer_argv(trainer: TrainerSpec, spec: KubernetesLaunchSpec) -> tuple[str, ...]:
    """The trainer's argv inside the image: ``trainer_command + [trainer_script] + trainer.args``.

    ``trainer_command`` defaults to ``python`` (the job's ``trainer.command`` names the worker's
    interpreter, which the image does not have); ``trainer_script`` to the job's ``trainer.script``.
    """
    command = tuple(spec.trainer_command or DEFAULT_TRAINER_COMMAND)
    return (*command, spec.trainer_script or trainer.script, *trainer.args)


def _local_path(location: str) -> str | None:
    """The filesystem path of a store location, or ``None`` for object storage (s3://, gs://, ...)."""
    if location.startswith("file://"):
        return location[len("file://") :]
    if "://" in location:
        return None
    return location


def store_path_in_pod(value: str, store_root: str, mount_path: str) -> str:
    """Where ``value`` (a path or file:// URI under ``store_root``) appears in a pod that mounts the root."""
    root, path = _local_path(store_root), _local_path(value)
    if root is None:
        raise LaunchError(
            f"store_mount mounts a file:// store, but the model store is {store_root!r}: leave store_mount out "
            "for an object store and give the pod its credentials as secret_env references"
        )
    root = root.rstrip("/") or "/"
    if path is None or not (path == root or path.startswith(root.rstrip("/") + "/")):
        raise LaunchError(f"{value!r} is not under the model store root {store_root!r}: the pod could not reach it")
    relative = path[len(root.rstrip("/")) :]
    if any(part in (".", "..") for part in relative.split("/")):
        raise LaunchError(f"{value!r} has '.' or '..' components: give store locations as plain paths")
    return mount_path.rstrip("/") + relative


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


def unreachable_store(spec: KubernetesLaunchSpec, store_root: str | None) -> str | None:
    """Why a pod of this site could not reach the model store, or ``None`` if it can."""
    if spec.store_mount is None and store_root is not None and _local_path(store_root) is not None:
        return (
            f"the model store {store_root} is a local path the pod cannot see: set launcher_spec.k8s.store_mount "
            "(a PVC or hostPath holding the store), or use an object store (s3://, gs://, ...) with its "
            "credentials as secret_env references"
        )
    return None


def _env(site_job: SiteJob, spec: KubernetesLaunchSpec, store_root: str | None) -> list[k8s.V1EnvVar]:
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


def allowed_host_paths(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The host path prefixes pods may mount (:data:`ALLOWED_HOST_PATHS_ENV`, ``':'``-separated).

    ``None`` when the variable is unset: then only the node's system directories are refused (by
    the job's validation). Set but empty: no host path at all. Read from the environment of the
    process that builds the pod (the Airflow worker), never from the job.
    """
    raw = (os.environ if environ is None else environ).get(ALLOWED_HOST_PATHS_ENV)
    if raw is None:
        return None
    prefixes = []
    for entry in filter(None, raw.split(":")):
        if not entry.startswith("/") or posixpath.normpath(entry) != (entry.rstrip("/") or "/"):
            raise LaunchError(
                f"{ALLOWED_HOST_PATHS_ENV}={raw!r}: {entry!r} is not a plain absolute path; "
                "the site admin must fix the worker's setting (e.g. /data:/scratch)"
            )
        prefixes.append(entry.rstrip("/") or "/")
    return tuple(prefixes)


def _check_host_paths(site_job: SiteJob, spec: KubernetesLaunchSpec) -> None:
    try:
        allowed = allowed_host_paths()
    except LaunchError as exc:
        raise LaunchError(f"{site_job.label}: {exc}") from None
    if allowed is None:
        return
    used = [(f"volume {vol.name!r}", vol.host_path) for vol in spec.volumes if vol.host_path is not None]
    if spec.store_mount is not None and spec.store_mount.host_path is not None:
        used.insert(0, ("store_mount", spec.store_mount.host_path))
    for what, path in used:
        if not any(path_within(path, top) for top in allowed):
            where = ", ".join(allowed) or "none"
            raise LaunchError(
                f"{site_job.label}: launcher_spec.k8s {what}: host_path {path} is not under a host path this site "
                f"allows ({ALLOWED_HOST_PATHS_ENV}: {where}); use a PVC or a directory under an allowed path, or ask "
                f"the site admin to add it to {ALLOWED_HOST_PATHS_ENV} on the Airflow workers"
            )


def _store_paths(site_job: SiteJob, spec: KubernetesLaunchSpec, store_root: str | None) -> dict[str, bool]:
    """The store paths the pod needs, relative to the store root, each with whether it is read-only:
    the input global model's tensors file and record (read-only: not the directory, which also
    holds the previous round's site updates) and the directory holding ``FLARE_OUTPUT``."""
    if spec.store_mount is None or store_root is None:
        return {}
    paths: dict[str, bool] = {}
    model = site_job.env.get("FLARE_GLOBAL_MODEL")
    if model is not None:
        relative = store_path_in_pod(model, store_root, "/").lstrip("/")
        paths[relative] = True
        paths[relative.removesuffix(".safetensors") + ".json"] = True
    output = site_job.env.get("FLARE_OUTPUT")
    if output is not None:
        directory = posixpath.dirname(store_path_in_pod(output, store_root, "/").lstrip("/"))
        # A directory that also holds the input stays writable: the output must be written.
        for path in [p for p in paths if p.startswith(directory + "/")]:
            del paths[path]
        paths[directory] = False
    return paths


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


def build_pod(
    site_job: SiteJob,
    spec: KubernetesLaunchSpec,
    resources: ResourceSpec,
    *,
    store_root: str | None,
    try_number: int = 1,
) -> k8s.V1Pod:
    """The pod of one site job.

    ``site_job.argv`` is the trainer's exact argv inside the image (see :func:`trainer_argv`; it
    becomes the container's ``command``, escaped against the kubelet's ``$(VAR)`` expansion);
    ``site_job.env`` holds the Client API's ``FLARE_*`` variables as the Airflow side computed them.
    With ``spec.store_mount``, ``FLARE_GLOBAL_MODEL`` and ``FLARE_OUTPUT`` must lie under
    ``store_root`` and are rewritten to the mount path; the pod mounts (``subPath``) only the
    directory of the first, read-only, and the directory of the second, read-write, each at its
    place under the mount path. Raises :class:`LaunchError` when the site job cannot run as a pod
    (no image, a store path the pod cannot reach, empty argv, a host path outside
    :func:`allowed_host_paths`).
    """
    if not spec.image:
        raise LaunchError(f"{site_job.label}: launcher_spec.k8s.image is not set; a pod needs the site's trainer image")
    if not site_job.argv:
        raise LaunchError(f"{site_job.label}: empty argv")
    _check_host_paths(site_job, spec)
    name = pod_name(site_job.job, site_job.site, site_job.round, site_job.run_id, try_number)
    labels = {**spec.labels, **pod_labels(site_job.job, site_job.run_id, site_job.round, site_job.site, try_number)}
    annotations = {**spec.annotations, RUN_ID_ANNOTATION: site_job.run_id}
    env = _env(site_job, spec, store_root)
    volumes, mounts = _volumes(spec, _store_paths(site_job, spec, store_root))
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


def _toleration(item: Mapping[str, Any]) -> k8s.V1Toleration:
    return k8s.V1Toleration(
        key=item.get("key"),
        operator=item.get("operator"),
        value=item.get("value"),
        effect=item.get("effect"),
        toleration_seconds=item.get("tolerationSeconds"),
    )


def job_pod(job: JobConfig, site: str, site_job: SiteJob, *, store_root: str | None, try_number: int = 1) -> k8s.V1Pod:
    """:func:`build_pod` for ``site`` of a validated job: the site's k8s block and resources, and the
    trainer's argv in the image (:func:`trainer_argv`) in place of ``site_job.argv``."""
    site_spec = job.sites[site]
    spec = site_spec.launcher_spec.k8s
    pod_job = replace(site_job, argv=trainer_argv(job.trainer, spec))
    return build_pod(pod_job, spec, site_spec.resource_spec, store_root=store_root, try_number=try_number)


_SERIALIZER: k8s.ApiClient | None = None


def pod_to_dict(pod: k8s.V1Pod) -> dict[str, Any]:
    """The pod as the JSON the API receives (camelCase keys, no ``None`` fields)."""
    global _SERIALIZER
    if _SERIALIZER is None:
        _SERIALIZER = k8s.ApiClient()
    result: dict[str, Any] = _SERIALIZER.sanitize_for_serialization(pod)
    return result


# ----------------------------------------------------------------------------- state table
@dataclass(frozen=True)
class PodStatus:
    """A pod's meaning for its site job (see :func:`map_pod`)."""

    state: JobState
    return_code: JobReturnCode
    reason: str
    done: bool
    waiting_for_resources: bool = False


def _failed(rc: JobReturnCode, reason: str) -> PodStatus:
    return PodStatus(JobState.FAILED, rc, reason, done=True)


def _container_statuses(status: Any) -> list[Any]:
    return list(status.init_container_statuses or []) + list(status.container_statuses or [])


def _our_volumes(pod: k8s.V1Pod) -> list[str]:
    # Projected volumes (the service account token) are the kubelet's business; their transient
    # "not registered" mount warnings must not fail a job.
    return [v.name for v in (pod.spec.volumes if pod.spec else None) or [] if v.projected is None]


def _mount_failure(pod: k8s.V1Pod, events: Iterable[Any]) -> str | None:
    names = _our_volumes(pod)

    def about_ours(message: str) -> bool:
        return any(re.search(rf"(?<![-a-z0-9.]){re.escape(n)}(?![-a-z0-9.])", message) for n in names)

    uid = pod.metadata.uid if pod.metadata else None
    for event in events:
        involved = getattr(event, "involved_object", None)
        if uid and involved is not None and involved.uid not in (None, uid):
            continue
        message = event.message or ""
        if event.reason in _MOUNT_FAILURE_EVENTS and about_ours(message):
            return f"{event.reason}: {message}"
    status = pod.status
    messages = [c.message for c in (status.conditions or []) if c.message] if status else []
    messages += [
        s.state.waiting.message
        for s in (_container_statuses(status) if status else [])
        if s.state and s.state.waiting and s.state.waiting.message
    ]
    for message in messages:
        if any(marker in message for marker in _MOUNT_FAILURE_TEXT) and about_ours(message):
            return f"FailedMount: {message}"
    return None


def _exit_status(term: Any) -> PodStatus:
    code = term.exit_code
    detail = f"{term.reason}: {term.message}" if term.message else (term.reason or "")
    if term.reason == "OOMKilled":
        return _failed(
            JobReturnCode.EXECUTION_ERROR,
            f"OOMKilled: the trainer exceeded its memory limit (exit code {code}); raise resource_spec.memory",
        )
    if code is None:
        return _failed(JobReturnCode.EXECUTION_ERROR, f"trainer terminated without an exit code ({detail or '?'})")
    if code == 0:
        # The pod failed although the trainer exited 0 (e.g. a sidecar failed): not a success.
        return _failed(JobReturnCode.EXECUTION_ERROR, f"pod failed although the trainer exited 0 ({detail or '?'})")
    _state, rc, reason = map_exit(code, terminated=False)
    if 128 < code < 160:
        with contextlib.suppress(ValueError):
            reason += f" ({signal.Signals(code - 128).name})"
    if detail and term.reason not in ("Error", "Completed"):
        reason += f": {detail}"
    return _failed(rc, reason)


def _trainer_termination(status: Any) -> Any:
    """The trainer container's termination record (current state first, then the last one)."""
    statuses = list(status.container_statuses or [])
    for s in [s for s in statuses if s.name == CONTAINER_NAME] or statuses[:1]:
        for state in (s.state, s.last_state):
            if state is not None and state.terminated is not None:
                return state.terminated
    return None


def map_pod(
    pod: k8s.V1Pod | None,
    *,
    now: datetime,
    pending_timeout: float,
    startup_timeout: float,
    events: Sequence[Any] = (),
) -> PodStatus:
    """The state table of the Kubernetes backend (``docs/state-mapping.md``).

    ``pod`` is the pod as read now, ``None`` when the API says it does not exist (404). ``events``
    are optional Warning events of the pod (``FailedMount`` fails fast: a volume that cannot be
    mounted). An unknown phase is never success.
    """
    if pod is None:
        return _failed(JobReturnCode.INFRASTRUCTURE_ERROR, _VANISHED)
    meta, status = pod.metadata, pod.status or k8s.V1PodStatus()
    phase = status.phase or "Pending"
    if phase == "Succeeded":
        return PodStatus(JobState.SUCCEEDED, JobReturnCode.SUCCESS, "", done=True)
    if meta is not None and meta.deletion_timestamp is not None:
        return PodStatus(
            JobState.TERMINATED,
            JobReturnCode.ABORTED,
            f"pod deleted before it finished (deletionTimestamp {meta.deletion_timestamp.isoformat()})",
            done=True,
        )
    if phase == "Failed":
        term = _trainer_termination(status)
        if term is not None:
            return _exit_status(term)
        why = ": ".join(x for x in (status.reason, status.message) if x) or "no reason given"
        return _failed(JobReturnCode.INFRASTRUCTURE_ERROR, f"pod failed before the trainer ran ({why})")
    if phase not in ("Pending", "Running"):
        return _failed(JobReturnCode.EXECUTION_ERROR, f"unknown pod phase {phase!r}")
    for s in _container_statuses(status):
        waiting = s.state.waiting if s.state else None
        if waiting is not None and waiting.reason in FAIL_FAST_REASONS:
            message = f": {waiting.message}" if waiting.message else ""
            return _failed(FAIL_FAST_REASONS[waiting.reason], f"{waiting.reason}{message}")
    if phase == "Running":
        return PodStatus(JobState.RUNNING, JobReturnCode.UNKNOWN, "", done=False)
    mount = _mount_failure(pod, events)
    if mount is not None:
        return _failed(JobReturnCode.INFRASTRUCTURE_ERROR, mount)
    created = meta.creation_timestamp if meta is not None else None
    pending_for = (now - created).total_seconds() if created is not None else 0.0
    scheduled = next((c for c in status.conditions or [] if c.type == "PodScheduled"), None)
    unschedulable = scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable"
    message = (scheduled.message or "") if scheduled is not None else ""
    if unschedulable and _INSUFFICIENT.search(message):
        if pending_for > pending_timeout:
            return _failed(
                JobReturnCode.INFRASTRUCTURE_ERROR,
                f"not scheduled within pending_timeout={pending_timeout:g}s: {message}",
            )
        return PodStatus(JobState.STARTING, JobReturnCode.UNKNOWN, message, done=False, waiting_for_resources=True)
    if pending_for > startup_timeout:
        why = message if unschedulable else _pending_detail(status)
        return _failed(
            JobReturnCode.INFRASTRUCTURE_ERROR,
            f"pod did not start within startup_timeout={startup_timeout:g}s" + (f": {why}" if why else ""),
        )
    return PodStatus(JobState.STARTING, JobReturnCode.UNKNOWN, "", done=False)


def _pending_detail(status: Any) -> str:
    for s in _container_statuses(status):
        waiting = s.state.waiting if s.state else None
        if waiting is not None and waiting.reason:
            return waiting.reason + (f": {waiting.message}" if waiting.message else "")
    for c in status.conditions or []:
        if c.status == "False" and (c.reason or c.message):
            return ": ".join(x for x in (c.reason, c.message) if x)
    return ""


# ----------------------------------------------------------------------------- launcher
_T = TypeVar("_T")
_REQUEST_TIMEOUT = 30
_GONE_EXTRA_SECONDS = 30.0


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in (0, 429) or (exc.status or 0) >= 500
    return isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


def _retrying(call: Callable[[], _T]) -> _T:
    """Run an idempotent API call, retrying transient failures (5xx, 429, connection errors) with backoff."""
    retryer = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_transient),
        stop=tenacity.stop_after_attempt(6) | tenacity.stop_after_delay(60),
        wait=tenacity.wait_exponential(multiplier=0.25, max=8),
        reraise=True,
    )
    return retryer(call)


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or exc.reason)


class KubernetesJobHandle(JobHandleSpec):
    """Handle of one site job's pod. Every read goes through :func:`map_pod`."""

    def __init__(self, launcher: KubernetesLauncher, job: SiteJob, pod: k8s.V1Pod) -> None:
        self.launcher = launcher
        self.job = job
        self.name: str = pod.metadata.name
        self.namespace: str = pod.metadata.namespace
        self.uid: str | None = pod.metadata.uid
        self._status = PodStatus(JobState.STARTING, JobReturnCode.UNKNOWN, "", done=False)
        self._final: PodStatus | None = None
        self._logs: str | None = None
        self._deleted = False
        self._lock = threading.RLock()

    @property
    def _core(self) -> k8s.CoreV1Api:
        return self.launcher.core

    @property
    def _spec(self) -> KubernetesLaunchSpec:
        return self.launcher.spec

    @property
    def status(self) -> PodStatus:
        """The last :class:`PodStatus` seen (``waiting_for_resources`` and the scheduler's message while Pending)."""
        return self._final or self._status

    def _read(self) -> k8s.V1Pod | None:
        def read() -> k8s.V1Pod | None:
            try:
                return self._core.read_namespaced_pod(self.name, self.namespace, _request_timeout=_REQUEST_TIMEOUT)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        pod = _retrying(read)
        if pod is not None and self.uid is not None and pod.metadata.uid != self.uid:
            return None  # a different pod under our name: ours is gone
        return pod

    def _warning_events(self, pod: k8s.V1Pod) -> list[Any]:
        # Mount failures show up only as events; read them while the pod is bound but not running.
        status = pod.status
        if not pod.spec.node_name or status is None or status.phase not in (None, "Pending"):
            return []
        if any(
            s.state and s.state.waiting and s.state.waiting.reason in FAIL_FAST_REASONS
            for s in _container_statuses(status)
        ):
            return []  # failing anyway
        selector = f"involvedObject.uid={pod.metadata.uid},type=Warning"

        def read() -> list[Any]:
            events = self._core.list_namespaced_event(
                self.namespace, field_selector=selector, _request_timeout=_REQUEST_TIMEOUT
            )
            return list(events.items)

        return _retrying(read)

    def poll(self) -> JobReturnCode:
        with self._lock:
            if self._final is not None:
                return self._final.return_code
            pod = self._read()
            events = self._warning_events(pod) if pod is not None else []
            spec = self._spec
            status = map_pod(
                pod,
                now=datetime.now(UTC),
                pending_timeout=spec.pending_timeout,
                startup_timeout=spec.startup_timeout,
                events=events,
            )
            self._status = status
            if status.done:
                self._finish(pod, status)
            return status.return_code

    @property
    def state(self) -> JobState:
        return self.status.state

    @property
    def reason(self) -> str:
        status = self.status
        return status.reason if status.done else ""

    def wait(self, timeout: float | None = None) -> JobReturnCode:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.poll()
            if self._final is not None:
                return rc
            if deadline is not None and time.monotonic() >= deadline:
                return JobReturnCode.UNKNOWN
            pause = self._spec.poll_interval
            if deadline is not None:
                pause = min(pause, max(0.0, deadline - time.monotonic()))
            time.sleep(pause)

    def logs(self) -> str:
        """The trainer container's log (kept after the pod is deleted; empty if it never started)."""
        with self._lock:
            if self._logs is not None:
                return self._logs
            return self._read_logs()

    def _read_logs(self) -> str:
        def read() -> str:
            try:
                # kubernetes 36 mangles the decoded body (str(bytes)); read the raw response.
                resp = self._core.read_namespaced_pod_log(
                    self.name,
                    self.namespace,
                    container=CONTAINER_NAME,
                    _preload_content=False,
                    _request_timeout=_REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status in (400, 404):  # not started yet / gone
                    return ""
                raise
            data: bytes = resp.data
            return data.decode(errors="replace")

        return _retrying(read)

    def _collect_logs(self, pod: k8s.V1Pod | None) -> None:
        self._logs = ""
        if not _started(pod):
            return
        try:
            self._logs = self._read_logs()
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            # A missing log must not keep the pod alive: note it and go on deleting.
            log.warning("%s: cannot read the log of pod %s/%s: %s", self.job.label, self.namespace, self.name, exc)
            return
        if self.launcher.sink is not None:
            prefix = f"[{self.job.site} r{self.job.round}] "
            for line in self._logs.splitlines():
                self.launcher.sink(prefix + line)

    def _finish(self, pod: k8s.V1Pod | None, status: PodStatus) -> None:
        self._final = status
        try:
            self._collect_logs(pod)
        finally:
            if pod is not None and not self._spec.keep_pods:
                self._delete(grace=None)

    def _delete(self, grace: int | None) -> None:
        def delete() -> None:
            try:
                self._core.delete_namespaced_pod(
                    self.name,
                    self.namespace,
                    body=k8s.V1DeleteOptions(
                        grace_period_seconds=grace, preconditions=k8s.V1Preconditions(uid=self.uid)
                    ),
                    _request_timeout=_REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status not in (404, 409):  # gone already / another pod under our name
                    raise

        if self._deleted:
            return
        _retrying(delete)
        limit = (grace if grace is not None else math.ceil(self.job.shutdown_timeout)) + _GONE_EXTRA_SECONDS
        deadline = time.monotonic() + limit
        while self._read() is not None:
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"{self.job.label}: pod {self.namespace}/{self.name} still exists {limit:g}s after its deletion"
                )
            time.sleep(0.2)
        self._deleted = True

    def terminate(self) -> None:
        """Delete the pod (grace = the job's shutdown timeout) and wait until it is gone. Idempotent.

        A pod that already finished keeps its result (success stays success) and, with
        ``keep_pods``, its pod.
        """
        with self._lock:
            if self._final is not None:
                if not self._spec.keep_pods:
                    self._delete(grace=None)
                return
            pod = self._read()
            status = map_pod(pod, now=datetime.now(UTC), pending_timeout=math.inf, startup_timeout=math.inf)
            if status.done:
                self._status = status
                self._finish(pod, status)
                return
            self._final = PodStatus(
                JobState.TERMINATED, JobReturnCode.ABORTED, "terminated: pod deleted on request", done=True
            )
            try:
                self._collect_logs(pod)
            finally:
                self._delete(grace=math.ceil(self.job.shutdown_timeout))


def _started(pod: k8s.V1Pod | None) -> bool:
    """Whether the trainer container ever ran (so that it has a log)."""
    if pod is None or pod.status is None:
        return False
    return any(
        s.state is not None and (s.state.running or s.state.terminated) for s in pod.status.container_statuses or []
    )


class KubernetesLauncher(JobLauncherSpec):
    """Launch site jobs as pods (NVIDIA FLARE's k8s launcher), outside Airflow.

    Parameters
    ----------
    spec, resources:
        The site's ``launcher_spec.k8s`` block and ``resource_spec``.
    store_root:
        The model store root as the caller sees it (path or file:// URI); needed with ``store_mount``.
    api_client:
        A ready ``kubernetes.client.ApiClient``; otherwise one is made from ``config_file`` /
        ``context`` (default: ``spec.config_file`` / ``spec.cluster_context``, or the in-cluster
        configuration when ``spec.in_cluster``). ``spec.kubernetes_conn_id`` is Airflow's and is
        not used here.
    try_number:
        Part of the pod's identity; ``fl_ctx["try_number"]`` overrides it per launch.
    sink:
        Receives the trainer's log lines when a job finishes.
    """

    def __init__(
        self,
        spec: KubernetesLaunchSpec,
        resources: ResourceSpec,
        *,
        store_root: str | None = None,
        api_client: k8s.ApiClient | None = None,
        config_file: str | None = None,
        context: str | None = None,
        try_number: int = 1,
        sink: LineSink | None = None,
    ) -> None:
        self.spec = spec
        self.resources = resources
        self.store_root = store_root
        self.try_number = try_number
        self.sink = sink
        if api_client is None:
            api_client = self._client(config_file or spec.config_file, context or spec.cluster_context)
        self.core = k8s.CoreV1Api(api_client)

    def _client(self, config_file: str | None, context: str | None) -> k8s.ApiClient:
        if self.spec.in_cluster:
            configuration = k8s.Configuration()
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s.ApiClient(configuration)
        return k8s_config.new_client_from_config(config_file=config_file, context=context)

    def launch_job(self, job_meta: SiteJob, fl_ctx: Mapping[str, Any] | None = None) -> KubernetesJobHandle:
        try_number = int((fl_ctx or {}).get("try_number", self.try_number))
        pod = build_pod(job_meta, self.spec, self.resources, store_root=self.store_root, try_number=try_number)
        self._make_output_dir(job_meta)
        try:
            created = self.core.create_namespaced_pod(self.spec.namespace, pod, _request_timeout=_REQUEST_TIMEOUT)
        except ApiException as exc:
            what = {409: "a pod with this name already exists", 422: "the API refused the pod"}.get(
                exc.status or 0, f"creating the pod failed (HTTP {exc.status})"
            )
            raise LaunchError(
                f"{job_meta.label}: {what}: {pod.metadata.namespace}/{pod.metadata.name}: {_api_message(exc)}"
            ) from exc
        return KubernetesJobHandle(self, job_meta, created)

    def _make_output_dir(self, job: SiteJob) -> None:
        # The kubelet creates a missing subPath directory owned by root, where the trainer (UID 1000)
        # could not write its update: create it first, as the store's owner.
        output = job.env.get("FLARE_OUTPUT")
        path = _local_path(output) if output is not None and self.spec.store_mount is not None else None
        if path is not None:
            os.makedirs(posixpath.dirname(path), exist_ok=True)
