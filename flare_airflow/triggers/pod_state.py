"""Pod-state trigger: watches one site pod (or the pods of a multi-node site job, as one) with
NVIDIA FLARE's launcher semantics.

It does not poll: it holds one watch on the pod (``list`` with a field selector, then ``watch``)
and re-opens it only when the API closes it or a deadline (``pending_timeout`` while the pod waits
for cpu/memory/GPUs, ``startup_timeout`` otherwise) needs checking, so the number of API requests
does not grow with the job's duration. Every decision comes from the one state table,
:func:`flare_airflow.launchers.kubernetes.map_pod`, fed with the pod's Warning events while it is
bound to a node but Pending: a volume that cannot be mounted (``FailedMount``) shows only as an
event, never as a pod change, so those events are read on each Pending update and every
``_EVENT_CHECK_SECONDS`` (the watch is kept that short meanwhile). Running pods cost no event reads.

Events (``TriggerEvent.payload``)::

    {"status": "success" | "failed" | "timeout", "name", "namespace", "state", "return_code",
     "reason", "message"}

``failed``: the pod ended (phase Failed) or vanished; ``timeout``: it never got to run to the end
(pending/startup timeout, image pull error, bad config) -- it may still exist and must be deleted;
``error``: the pod could not be watched (the API kept failing); it may still run.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from flare_airflow.core.config import KubernetesLaunchSpec
from flare_airflow.core.spec import EventStatus, JobReturnCode, JobState, JobStatus, SiteJobEvent
from flare_airflow.hooks.kubernetes import kubeconfig_dict
from flare_airflow.launchers.kubernetes import GroupStatus, map_pod, map_pod_group
from flare_airflow.launchers.kubernetes.api import (
    delete_group_async,
    delete_pod_async,
    list_warning_events_async,
    needs_warning_events,
)

# Apiservers end watches after --min-request-timeout (30-60 min by default); ask for as long.
_MAX_WATCH_SECONDS = 1800
# Client side: a list may take this long; a watch may stay silent for its own length + _READ_SLACK.
_REQUEST_TIMEOUT = 60
_CONNECT_TIMEOUT = 30
_READ_SLACK = 30
# Transient API failures in a row (timeouts, resets, 5xx, 429) before the trigger gives up (~2.5 min).
_MAX_FAILURES = 8
# While a bound pod is Pending its Warning events are read this often: a FailedMount fails in seconds.
_EVENT_CHECK_SECONDS = 5


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
    :param execution_deadline: epoch seconds after which the pod is deleted (the task's execution_timeout).
    :param grace_period: seconds the pod gets to stop when this trigger deletes it.
    :param delete_on_kill: delete the pod when the deferred task is killed or marked failed.
    :param redefer_count: how many times the operator re-deferred after an ``error`` event (echoed back).
    :param group_selector: a multi-node site job: the label selector of its pods and Service (this
        try's identity); the trigger watches every pod it selects, as one site job.
    :param group_pods: the group's pod names in node-rank order (``pod_name`` is rank 0's).
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
        "redefer_count",
        "group_selector",
        "group_pods",
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
        redefer_count: int = 0,
        group_selector: str | None = None,
        group_pods: list[str] | None = None,
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
        self.redefer_count = redefer_count
        self.group_selector = group_selector
        self.group_pods = group_pods
        self._fired = False
        self._events_readable = True

    @classmethod
    def for_site(
        cls, spec: KubernetesLaunchSpec, *, pod_name: str, pod_namespace: str, **watch: Any
    ) -> PodStateTrigger:
        """The trigger of a pod of a site whose ``launcher_spec.k8s`` is ``spec``: its cluster and
        start-up timeouts from the spec; ``watch``: the other arguments (deadline, grace, kill, group).
        The one place the pod task and the sensor make it."""
        return cls(
            pod_name=pod_name,
            pod_namespace=pod_namespace,
            kubernetes_conn_id=spec.kubernetes_conn_id,
            config_dict=kubeconfig_dict(spec.config_file),
            in_cluster=spec.in_cluster,
            cluster_context=spec.cluster_context,
            pending_timeout=spec.pending_timeout,
            startup_timeout=spec.startup_timeout,
            **watch,
        )

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

    def _event(self, status: JobStatus, pod: Any, name: str | None = None) -> TriggerEvent:
        name = name or self.pod_name
        phase = getattr(getattr(pod, "status", None), "phase", None)
        kind: EventStatus
        if status.state is JobState.SUCCEEDED:
            kind = "success"
        elif phase == "Failed" or pod is None:
            kind = "failed"
        else:
            kind = "timeout"  # never ran to the end: the operator must not wait for completion
        event: SiteJobEvent = {
            "status": kind,
            "name": name,
            "namespace": self.pod_namespace,
            "state": status.state.value,
            "return_code": int(status.return_code),
            "reason": status.reason,
            "message": f"pod {self.pod_namespace}/{name}: {status.reason or status.state.value}",
        }
        return TriggerEvent(event)

    def _deadline_event(self) -> TriggerEvent:
        reason = "execution_timeout reached: the site job ran too long; its pod was deleted"
        event: SiteJobEvent = {
            "status": "timeout",
            "name": self.pod_name,
            "namespace": self.pod_namespace,
            "state": JobState.TERMINATED.value,
            "return_code": int(JobReturnCode.ABORTED),
            "reason": reason,
            "message": f"pod {self.pod_namespace}/{self.pod_name}: {reason}",
        }
        return TriggerEvent(event)

    def _seconds_left(self) -> float | None:
        if self.execution_deadline is None:
            return None
        return self.execution_deadline - time.time()

    async def _delete(self, core: Any) -> None:
        """Delete the pod, or every pod and the Service of the group."""
        if self.group_selector is not None:
            await delete_group_async(core, self.pod_namespace, self.group_selector, grace=self.grace_period)
        else:
            await delete_pod_async(core, self.pod_namespace, self.pod_name, grace=self.grace_period)

    async def on_kill(self) -> None:
        """The task was killed or marked failed while deferred: delete its pod (Airflow >= 3.3)."""
        if self._fired or not self.delete_on_kill:
            return
        from kubernetes_asyncio import client

        what = f"the pods of {self.group_selector}" if self.group_selector else self.pod_name
        self.log.info("task killed: deleting %s in %s", what, self.pod_namespace)
        async with self._hook().get_conn() as api:
            await self._delete(client.CoreV1Api(api))

    def _status(self, pod: Any, events: list[Any] | None = None) -> JobStatus:
        return map_pod(
            pod,
            now=datetime.now(UTC),
            pending_timeout=self.pending_timeout,
            startup_timeout=self.startup_timeout,
            events=events or (),
        )

    def _needs_events(self, pod: Any) -> bool:
        """The shared start-up rule (:func:`needs_warning_events`), while this site may read events."""
        return self._events_readable and needs_warning_events(pod)

    async def _warnings(self, core: Any, pod: Any) -> list[Any]:
        """The pod's Warning events: one list request, filtered by the API."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return await list_warning_events_async(core, self.pod_namespace, pod, request_timeout=_REQUEST_TIMEOUT)
        except ApiException as exc:
            if exc.status in (401, 403):  # the site's role may not read events: watch the pod alone
                self.log.warning(
                    "cannot read events of pod %s (%s): mount failures show only at startup_timeout",
                    getattr(getattr(pod, "metadata", None), "name", None) or self.pod_name,
                    exc.status,
                )
                self._events_readable = False
                return []
            raise

    async def _decide(self, core: Any, pod: Any) -> JobStatus:
        status = self._status(pod)
        if status.done or not self._needs_events(pod):
            return status
        return self._status(pod, await self._warnings(core, pod))

    @property
    def _names(self) -> list[str]:
        return list(self.group_pods or [self.pod_name])

    async def _decide_group(self, core: Any, pods: dict[str, Any]) -> GroupStatus:
        """The site job's status from its pods (absent from ``pods``: gone), through map_pod_group;
        one pod's through :meth:`_decide`, as it always was."""
        if not self.group_pods:
            return GroupStatus(self.pod_name, await self._decide(core, pods.get(self.pod_name)))
        ordered = [(name, pods.get(name)) for name in self._names]
        events: dict[str, list[Any]] = {}
        for name, pod in ordered:
            if pod is not None and not self._status(pod).done and self._needs_events(pod):
                events[name] = await self._warnings(core, pod)
        return map_pod_group(
            ordered,
            now=datetime.now(UTC),
            pending_timeout=self.pending_timeout,
            startup_timeout=self.startup_timeout,
            events=events,
        )

    def _error_event(self, reason: str) -> TriggerEvent:
        event: SiteJobEvent = {
            "status": "error",
            "name": self.pod_name,
            "namespace": self.pod_namespace,
            "state": JobState.UNKNOWN.value,
            "return_code": int(JobReturnCode.INFRASTRUCTURE_ERROR),
            "reason": reason,
            "message": f"pod {self.pod_namespace}/{self.pod_name}: {reason}",
            "_redefer_count": self.redefer_count,
        }
        return TriggerEvent(event)

    def _watch_seconds(self, pod: Any) -> int:
        """How long one watch may last before the deadlines need checking again."""
        wait = _MAX_WATCH_SECONDS
        if pod is not None and getattr(pod.status, "phase", None) == "Pending":
            wait = max(1, int(min(self.pending_timeout, self.startup_timeout) / 2) or 1)
        if self._needs_events(pod):
            wait = min(wait, _EVENT_CHECK_SECONDS)
        left = self._seconds_left()
        if left is not None:
            wait = max(1, min(wait, math.ceil(left)))
        return wait

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Watch the pod until it is done; never raise (an ``error`` event carries the reason).

        The watch outlives every client-side and server-side timeout: when a watch ends (the
        server's ``timeoutSeconds``, a dropped connection, a client timeout, an API restart), it
        resumes from the last resourceVersion seen; only a ``410 Gone`` (that version was
        compacted) makes it list the pod again. Transient failures back off; a run of
        ``_MAX_FAILURES`` of them in a row, or an error that retrying cannot fix (401/403/404 on
        the list), ends the trigger with an ``error`` event so that the operator can clean up.
        """
        try:
            event = await self._watch()
        except Exception as exc:  # an error event lets the operator delete the pod; a raise would not
            self.log.exception("watching pod %s/%s failed", self.pod_namespace, self.pod_name)
            event = self._error_event(f"watching the pod failed: {type(exc).__name__}: {exc}")
        self._fired = True
        yield event

    async def _watch(self) -> TriggerEvent:
        """The pod's first decisive event (its API connection is closed when this returns)."""
        from kubernetes_asyncio import client, watch
        from kubernetes_asyncio.client.exceptions import ApiException

        # One pod by name, or every pod of a multi-node site job by its labels: one watch either way.
        selector: dict[str, Any] = (
            {"label_selector": self.group_selector}
            if self.group_selector
            else {"field_selector": f"metadata.name={self.pod_name}"}
        )
        async with self._hook().get_conn() as api:
            core = client.CoreV1Api(api)
            failures = 0
            pods: dict[str, Any] = {}
            version: str | None = None  # None: list (again) before watching
            while True:
                try:
                    if version is None:
                        listed = await core.list_namespaced_pod(
                            self.pod_namespace, **selector, _request_timeout=_REQUEST_TIMEOUT
                        )
                        pods = {item.metadata.name: item for item in listed.items}
                        version = listed.metadata.resource_version
                    group = await self._decide_group(core, pods)
                    if group.status.done:
                        return self._event(group.status, pods.get(group.pod), group.pod)
                    left = self._seconds_left()
                    if left is not None and left <= 0:
                        await self._delete(core)
                        return self._deadline_event()
                    wait = min(self._watch_seconds(pods.get(name)) for name in self._names)
                    # The provider's API client gives every request a 60 s total timeout unless the
                    # call names its own: a watch states how long it may stay silent instead.
                    stream = watch.Watch().stream(
                        core.list_namespaced_pod,
                        self.pod_namespace,
                        **selector,
                        resource_version=version,
                        timeout_seconds=wait,
                        allow_watch_bookmarks=True,
                        _request_timeout=(_CONNECT_TIMEOUT, wait + _READ_SLACK),
                    )
                    async for item in stream:
                        obj = item["object"]
                        meta = obj.get("metadata", {}) if isinstance(obj, dict) else getattr(obj, "metadata", None)
                        seen = (
                            meta.get("resourceVersion")
                            if isinstance(meta, dict)
                            else getattr(meta, "resource_version", None)
                        )
                        if seen:
                            version = seen
                        failures = 0
                        if item["type"] == "BOOKMARK":
                            continue
                        name = meta.get("name") if isinstance(meta, dict) else getattr(meta, "name", None)
                        if name and item["type"] == "DELETED":
                            pods.pop(name, None)
                        elif name:
                            pods[name] = obj
                        group = await self._decide_group(core, pods)
                        if group.status.done:
                            return self._event(group.status, pods.get(group.pod), group.pod)
                    failures = 0  # the server ended the watch (timeoutSeconds): check deadlines, go on
                except ApiException as exc:
                    if exc.status == 410:  # the resourceVersion was compacted away: list again
                        self.log.info(
                            "watch of pod %s: resourceVersion %s expired; listing again", self.pod_name, version
                        )
                        version = None
                        continue
                    if exc.status is not None and exc.status < 500 and exc.status != 429:
                        raise
                    failures = await self._back_off(failures, exc)
                except (TimeoutError, OSError, _client_errors()) as exc:
                    failures = await self._back_off(failures, exc)

    async def _back_off(self, failures: int, exc: BaseException) -> int:
        failures += 1
        if failures > _MAX_FAILURES:
            raise exc
        delay = 0 if failures == 1 else min(2 ** (failures - 1), 30)  # a dropped watch resumes at once
        self.log.warning(
            "watching pod %s failed (%s: %s); resuming in %d s (%d/%d)",
            self.pod_name, type(exc).__name__, exc, delay, failures, _MAX_FAILURES,
        )  # fmt: skip
        await asyncio.sleep(delay)
        return failures


def _client_errors() -> type[BaseException]:
    import aiohttp

    return aiohttp.ClientError
