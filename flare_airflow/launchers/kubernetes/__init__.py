"""The Kubernetes backend: a site job is one pod, or one pod per node plus a headless Service
(``nodes: N``). Usable without Airflow.

Rooms (the same as every backend's):

* :mod:`.naming` -- the pod's identity: :func:`pod_name` (RFC 1123, at most 63 characters,
  ``fl-<job>-<site>-r<round>-<hash>``, unique per run, round, site and try), :func:`pod_labels`
  and :func:`site_pods_selector`.
* :mod:`.manifest` -- the ONE place a site job's pod manifest is built (:func:`build_pod`,
  :func:`job_pod`), with :mod:`.storage` saying which store and host paths a pod may reach.
* :mod:`.state` -- the state table (:func:`map_pod`, ``docs/state-mapping.md``).
* :mod:`.launcher` -- :class:`KubernetesLauncher` / :class:`KubernetesJobHandle` (the launcher
  spec), with :mod:`.api` for API calls (retries with backoff, :func:`delete_site_pods`).

How the Airflow pod operator uses this package (it must not build a manifest of its own)::

    pod = job_pod(job, site, site_job, store_root=str(store_root), try_number=ti.try_number)
    # either: KubernetesPodOperator(full_pod_spec=pod, base_container_name=CONTAINER_NAME, ...)
    # or: override build_pod_request_obj() to return this pod plus the operator's own
    #     identifying labels (self._get_ti_pod_labels(context)), so that re-attaching works.
    # The pod-state trigger calls map_pod(pod_or_None, now=..., pending_timeout=spec.pending_timeout,
    # startup_timeout=spec.startup_timeout) on every read and stops when .done.

Only this package imports ``kubernetes`` (the launchers package does not import it by default).
"""

from __future__ import annotations

from flare_airflow.core.envvars import STORE_PATH_VARS
from flare_airflow.launchers.kubernetes.api import delete_pod, delete_service, delete_site_pods
from flare_airflow.launchers.kubernetes.launcher import KubernetesJobHandle, KubernetesLauncher
from flare_airflow.launchers.kubernetes.manifest import (
    GPU_RESOURCE,
    RUN_AS_USER,
    SiteJobObjects,
    build_pod,
    build_service,
    build_site_job,
    job_pod,
    job_site_job,
    pod_to_dict,
)
from flare_airflow.launchers.kubernetes.naming import (
    CONTAINER_NAME,
    NODE_RANK_LABEL,
    group_name,
    node_pod_name,
    pod_labels,
    pod_name,
    site_job_selector,
    site_pods_selector,
)
from flare_airflow.launchers.kubernetes.state import FAIL_FAST_REASONS, GroupStatus, map_pod, map_pod_group
from flare_airflow.launchers.kubernetes.storage import (
    ALLOWED_HOST_PATHS_ENV,
    allowed_host_paths,
    store_path_in_pod,
    unreachable_store,
)
from flare_airflow.launchers.trainer import trainer_argv

__all__ = [
    "ALLOWED_HOST_PATHS_ENV",
    "CONTAINER_NAME",
    "FAIL_FAST_REASONS",
    "GPU_RESOURCE",
    "NODE_RANK_LABEL",
    "RUN_AS_USER",
    "STORE_PATH_VARS",
    "GroupStatus",
    "KubernetesJobHandle",
    "KubernetesLauncher",
    "SiteJobObjects",
    "allowed_host_paths",
    "build_pod",
    "build_service",
    "build_site_job",
    "delete_pod",
    "delete_service",
    "delete_site_pods",
    "group_name",
    "job_pod",
    "job_site_job",
    "map_pod",
    "map_pod_group",
    "node_pod_name",
    "pod_labels",
    "pod_name",
    "pod_to_dict",
    "site_job_selector",
    "site_pods_selector",
    "store_path_in_pod",
    "trainer_argv",
    "unreachable_store",
]
