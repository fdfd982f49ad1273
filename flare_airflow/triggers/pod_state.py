"""Pod-state trigger: watches one site pod with NVIDIA FLARE's launcher semantics.

It does not poll: it holds one watch on the pod (``list`` with a field selector, then ``watch``)
and re-opens it only when the API closes it or a deadline (``pending_timeout`` while the pod waits
for cpu/memory/GPUs, ``startup_timeout`` otherwise) needs checking, so the number of API requests
does not grow with the job's duration. Every decision comes from the one state table,
:func:`flare_airflow.launchers.kubernetes.map_pod`.

Events (``TriggerEvent.payload``)::

    {"status": "success" | "failed" | "timeout", "name", "namespace", "state", "return_code",
     "reason", "message"}

``failed``: the pod ended (phase Failed) or vanished; ``timeout``: it never got to run to the end
(pending/startup timeout, image pull error, bad config) -- it may still exist and must be deleted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from flare_airflow.core.spec import JobReturnCode, JobState
from flare_airflow.launchers.kubernetes import PodStatus, map_pod

# Apiservers end watches after --min-request-timeout (30-60 min by default); ask for as long.
_MAX_WATCH_SECONDS = 1800


class PodStateTrigger(BaseTrigger):
    """Wait for a site pod to finish, fail fast, or time out while pending.

    :param pod_name: the pod to watch.
    :param pod_namespace: its namespace.
    :param kubernetes_conn_id: Airflow connection of the site's cluster (``None``: in-cluster or kubeconfig).
    :param config_dict: a kubeconfig as a dict (what ``KubernetesPodOperator`` passes to its trigger).
    :param in_cluster: use the in-cluster configuration.
    :param cluster_context: kubeconfig context.
    :param pending_timeout: seconds a pod may wait for cpu / memory / GPUs.
    :param startup_timeout: seconds a pod may stay Pending for any other reason.
    """

    # The constructor's keyword arguments: what serialize() hands the triggerer.
    _FIELDS = (
        "pod_name",
        "pod_namespace",
        "kubernetes_conn_id",
        "config_dict",
        "in_cluster",
        "cluster_context",
        "connection_extras",
        "pending_timeout",
        "startup_timeout",
        "execution_deadline",
        "grace_period",
        "delete_on_kill",
    )

    def __init__(
        self,
        *,
        pod_name: str,
        pod_namespace: str,
        kubernetes_conn_id: str | None = None,
        config_dict: dict[str, Any] | None = None,
        in_cluster: bool | None = None,
        cluster_context: str | None = None,
        connection_extras: dict[str, Any] | None = None,
        pending_timeout: float = 300.0,
        startup_timeout: float = 120.0,
        execution_deadline: float | None = None,
        grace_period: int = 10,
        delete_on_kill: bool = True,
    ) -> None:
        super().__init__()
        self.pod_name = pod_name
        self.pod_namespace = pod_namespace
        self.kubernetes_conn_id = kubernetes_conn_id
        self.config_dict = config_dict
        self.in_cluster = in_cluster
        self.cluster_context = cluster_context
        self.connection_extras = connection_extras
        self.pending_timeout = pending_timeout
        self.startup_timeout = startup_timeout
        self.execution_deadline = execution_deadline
        self.grace_period = grace_period
        self.delete_on_kill = delete_on_kill
        self._fired = False

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {f: getattr(self, f) for f in self._FIELDS}

    def _hook(self) -> Any:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

        return AsyncKubernetesHook(
            conn_id=self.kubernetes_conn_id,
            in_cluster=self.in_cluster,
            config_dict=self.config_dict,
            cluster_context=self.cluster_context,
            connection_extras=self.connection_extras,
        )

    def _event(self, status: PodStatus, pod: Any) -> TriggerEvent:
        phase = getattr(getattr(pod, "status", None), "phase", None)
        if status.state is JobState.SUCCEEDED:
            kind = "success"
        elif phase == "Failed" or pod is None:
            kind = "failed"
        else:
            kind = "timeout"  # never ran to the end: the operator must not wait for completion
        return TriggerEvent(
            {
                "status": kind,
                "name": self.pod_name,
                "namespace": self.pod_namespace,
                "state": status.state.value,
                "return_code": int(status.return_code),
                "reason": status.reason,
                "message": f"pod {self.pod_namespace}/{self.pod_name}: {status.reason or status.state.value}",
            }
        )

    def _deadline_event(self) -> TriggerEvent:
        reason = "execution_timeout reached: the site job ran too long; its pod was deleted"
        return TriggerEvent(
            {
                "status": "timeout",
                "name": self.pod_name,
                "namespace": self.pod_namespace,
                "state": JobState.TERMINATED.value,
                "return_code": int(JobReturnCode.ABORTED),
                "reason": reason,
                "message": f"pod {self.pod_namespace}/{self.pod_name}: {reason}",
            }
        )

    def _seconds_left(self) -> float | None:
        if self.execution_deadline is None:
            return None
        return self.execution_deadline - time.time()

    async def _delete(self, core: Any) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            await core.delete_namespaced_pod(self.pod_name, self.pod_namespace, grace_period_seconds=self.grace_period)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def on_kill(self) -> None:
        """The task was killed or marked failed while deferred: delete its pod (Airflow >= 3.3)."""
        if self._fired or not self.delete_on_kill:
            return
        from kubernetes_asyncio import client

        self.log.info("task killed: deleting pod %s/%s", self.pod_namespace, self.pod_name)
        async with self._hook().get_conn() as api:
            await self._delete(client.CoreV1Api(api))

    def _status(self, pod: Any) -> PodStatus:
        return map_pod(
            pod,
            now=datetime.now(UTC),
            pending_timeout=self.pending_timeout,
            startup_timeout=self.startup_timeout,
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from kubernetes_asyncio import client, watch
        from kubernetes_asyncio.client.exceptions import ApiException

        selector = f"metadata.name={self.pod_name}"
        async with self._hook().get_conn() as api:
            core = client.CoreV1Api(api)
            attempts = 0
            while True:
                try:
                    listed = await core.list_namespaced_pod(self.pod_namespace, field_selector=selector)
                    attempts = 0
                except (TimeoutError, ApiException, OSError) as exc:
                    if isinstance(exc, ApiException) and exc.status is not None and exc.status < 500:
                        raise
                    attempts += 1
                    if attempts > 5:
                        raise
                    self.log.warning("reading pod %s failed (%s); retrying", self.pod_name, exc)
                    await asyncio.sleep(min(2**attempts, 30))
                    continue
                pod = listed.items[0] if listed.items else None
                status = self._status(pod)
                if status.done:
                    self._fired = True
                    yield self._event(status, pod)
                    return
                left = self._seconds_left()
                if left is not None and left <= 0:
                    await self._delete(core)
                    self._fired = True
                    yield self._deadline_event()
                    return
                # Wait for changes, but wake up in time to enforce the pending/startup/execution deadlines.
                wait = _MAX_WATCH_SECONDS
                if pod is not None and getattr(pod.status, "phase", None) == "Pending":
                    wait = max(1, int(min(self.pending_timeout, self.startup_timeout) / 2) or 1)
                if left is not None:
                    wait = max(1, min(wait, math.ceil(left)))
                stream = watch.Watch().stream(
                    core.list_namespaced_pod,
                    self.pod_namespace,
                    field_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=wait,
                )
                try:
                    async for item in stream:
                        obj = item["object"]
                        current = None if item["type"] == "DELETED" else obj
                        status = self._status(current)
                        if status.done:
                            self._fired = True
                            yield self._event(status, current)
                            return
                except ApiException as exc:
                    if exc.status != 410:  # 410: resourceVersion too old -- list again
                        raise
