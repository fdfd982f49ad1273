"""A Kubernetes site's cluster from Airflow: the one place its client and kubeconfig are made.

The site's ``launcher_spec.k8s`` names the cluster (an Airflow connection, in-cluster, or a
kubeconfig file and context); the cncf provider's ``KubernetesHook`` turns that into a client, for
the launcher, the pod task's earlier-tries cleanup and the run's sweep alike. The triggerer may
not see the worker's files, so a trigger gets the kubeconfig as a dict (:func:`kubeconfig_dict`),
as the stock operator sends it. Pod I/O itself (delete, events) lives in
:mod:`flare_airflow.launchers.kubernetes.api`, in sync and async forms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from flare_airflow.core.config import KubernetesLaunchSpec

if TYPE_CHECKING:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook


def site_hook(spec: KubernetesLaunchSpec) -> KubernetesHook:
    """The hook of the site's cluster (``hook.api_client``, ``hook.core_v1_client``)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    return KubernetesHook(
        conn_id=spec.kubernetes_conn_id,
        in_cluster=spec.in_cluster,
        config_file=spec.config_file,
        cluster_context=spec.cluster_context,
    )


def kubeconfig_dict(path: str | None) -> dict[str, Any] | None:
    """The kubeconfig file as a dict for the triggerer (read here rather than through the stock
    operator's private ``_config_dict``); ``None`` without a file."""
    if not path:
        return None
    with open(path, encoding="utf-8") as fh:
        loaded = yaml.safe_load(fh)
    return loaded if isinstance(loaded, dict) else None
