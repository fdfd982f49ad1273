"""A multi-node Kubernetes site job (``nodes > 1``) in the pod task: its other ranks' pods and its
headless Service beside rank 0's pod, named per try so that every exit path can delete them.

The stock operator creates, watches and deletes rank 0's pod only; this module adds the rest of the
group from the one manifest builder (:func:`flare_airflow.launchers.kubernetes.job_site_job`) and
deletes it with the same label selector the launcher and the sweep use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flare_airflow.core.config import JobConfig
from flare_airflow.core.spec import JobIdentity
from flare_airflow.launchers.kubernetes import (
    delete_site_pods,
    group_name,
    job_site_job,
    node_pod_name,
    site_job_selector,
)
from flare_airflow.site_task.spec import SiteRun


@dataclass(frozen=True)
class PodGroup:
    """One try's group: the label selector that finds its pods and Service, and its pods by rank."""

    selector: str
    names: list[str]


def pod_group(job: JobConfig, site: str, run_id: str, round_num: int, try_number: int) -> PodGroup | None:
    """This try's group of a multi-node site job; None for a one-pod site job."""
    nodes = job.sites[site].launcher_spec.k8s.nodes
    if nodes <= 1:
        return None
    identity = JobIdentity(job.job, run_id, round_num, site, try_number)
    group = group_name(job.job, site, round_num, run_id, try_number, nodes)
    return PodGroup(site_job_selector(identity), [node_pod_name(group, rank) for rank in range(nodes)])


def create_other_ranks(
    client: Any,
    job: JobConfig,
    site: str,
    run: SiteRun,
    *,
    store_root: str,
    try_number: int,
    namespace: str,
    labels: Mapping[str, str],
    log: Any,
) -> None:
    """Create the group's headless Service and the pods of ranks 1.. (rank 0's is the stock
    operator's), each with the operator's own identifying ``labels`` as rank 0's pod has them."""
    objects = job_site_job(job, site, run.site_job(), store_root=store_root, try_number=try_number)
    assert objects.service is not None  # the manifest builder makes one for every nodes > 1 site job
    client.create_namespaced_service(namespace, objects.service)
    for pod in objects.pods[1:]:
        pod.metadata.labels.update(labels)
        client.create_namespaced_pod(namespace, pod)
    log.info(
        "site %s round %d: %d pods (one per node) and headless Service %s in %s",
        site, run.round, len(objects.pods), objects.service.metadata.name, namespace,
    )  # fmt: skip


def delete_group_quietly(
    client: Any, job: JobConfig, site: str, round_num: int, group: PodGroup | None, log: Any
) -> None:
    """Delete every pod of the group and its Service (a site that keeps pods keeps the finished
    ones); nothing for a one-pod site job. Never raises: it runs on exit paths whose own error
    matters more, so a failure is logged saying which pods may remain."""
    if group is None:
        return
    spec = job.sites[site].launcher_spec.k8s
    try:
        deleted = delete_site_pods(client, spec.namespace, group.selector, keep_finished=spec.keep_pods)
    except Exception as exc:
        log.warning("could not delete the pods of %s: %s", group.selector, exc)
        return
    if deleted:
        log.info("site %s round %d: deleted %s", site, round_num, ", ".join(deleted))
