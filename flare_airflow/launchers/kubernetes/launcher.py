"""The Kubernetes launcher spec for callers outside Airflow (a CLI, an NVFlare-style caller).

:class:`KubernetesLauncher` creates a site job's pod (built by
:func:`~flare_airflow.launchers.kubernetes.manifest.build_pod`); :class:`KubernetesJobHandle`
polls it through :func:`~flare_airflow.launchers.kubernetes.state.map_pod` (API reads retried
with backoff) and deletes it when it finishes (unless the site keeps pods) or when terminated.
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from flare_airflow.core.config import KubernetesLaunchSpec, ResourceSpec
from flare_airflow.core.envvars import FLARE_OUTPUT
from flare_airflow.core.spec import (
    JobHandleSpec,
    JobIdentity,
    JobLauncherSpec,
    JobReturnCode,
    JobState,
    LineSink,
    SiteJob,
    wait_by_polling,
)
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.kubernetes.api import (
    REQUEST_TIMEOUT,
    api_message,
    delete_site_pods,
    list_site_pods,
    retrying,
)
from flare_airflow.launchers.kubernetes.manifest import build_pod
from flare_airflow.launchers.kubernetes.naming import CONTAINER_NAME, site_job_selector, site_pods_selector
from flare_airflow.launchers.kubernetes.state import (
    FAIL_FAST_REASONS,
    PodStatus,
    container_statuses,
    map_pod,
    trainer_started,
)
from flare_airflow.launchers.kubernetes.storage import local_path
from flare_airflow.launchers.trainer import output_prefix

log = logging.getLogger(__name__)

_GONE_EXTRA_SECONDS = 30.0


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
                return self._core.read_namespaced_pod(self.name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        pod = retrying(read)
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
            for s in container_statuses(status)
        ):
            return []  # failing anyway
        selector = f"involvedObject.uid={pod.metadata.uid},type=Warning"

        def read() -> list[Any]:
            events = self._core.list_namespaced_event(
                self.namespace, field_selector=selector, _request_timeout=REQUEST_TIMEOUT
            )
            return list(events.items)

        return retrying(read)

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
        return wait_by_polling(self.poll, lambda: self._final is not None, self._spec.poll_interval, timeout)

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
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status in (400, 404):  # not started yet / gone
                    return ""
                raise
            data: bytes = resp.data
            return data.decode(errors="replace")

        return retrying(read)

    def _collect_logs(self, pod: k8s.V1Pod | None) -> None:
        self._logs = ""
        if not trainer_started(pod):
            return
        try:
            self._logs = self._read_logs()
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            # A missing log must not keep the pod alive: note it and go on deleting.
            log.warning("%s: cannot read the log of pod %s/%s: %s", self.job.label, self.namespace, self.name, exc)
            return
        if self.launcher.sink is not None:
            prefix = output_prefix(self.job)
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
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status not in (404, 409):  # gone already / another pod under our name
                    raise

        if self._deleted:
            return
        retrying(delete)
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
            created = self.core.create_namespaced_pod(self.spec.namespace, pod, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as exc:
            what = {409: "a pod with this name already exists", 422: "the API refused the pod"}.get(
                exc.status or 0, f"creating the pod failed (HTTP {exc.status})"
            )
            raise LaunchError(
                f"{job_meta.label}: {what}: {pod.metadata.namespace}/{pod.metadata.name}: {api_message(exc)}"
            ) from exc
        return KubernetesJobHandle(self, job_meta, created)

    def find_job(self, identity: JobIdentity, *, shutdown_timeout: float = 10.0) -> KubernetesJobHandle | None:
        """The handle of the pod launched under ``identity`` (found by its labels in the site's
        namespace, whoever created it), or ``None`` when no such pod exists (never created, or
        deleted once it finished). Polling the handle maps the pod as a fresh launch would; a
        finished pod gives its result (and is deleted unless the site keeps pods)."""
        pods = list_site_pods(self.core, self.spec.namespace, site_job_selector(identity))
        if not pods:
            return None
        # Several pods of one launch: a multi-pod site job; the first by name stands for it here.
        pod = min(pods, key=lambda p: str(p.metadata.name))
        return KubernetesJobHandle(self, identity.site_job(shutdown_timeout), pod)

    def terminate_earlier_tries(self, identity: JobIdentity) -> list[str]:
        """Delete the pods of the tries of this site job before ``identity``'s (found by their
        labels): they run unwatched, their tries are over. A site that keeps pods keeps the
        finished ones. Returns what was deleted, as ``<pod> (try N, <phase>)``."""
        selector = site_pods_selector(identity.job, identity.run_id, identity.round, identity.site)
        return delete_site_pods(
            self.core,
            self.spec.namespace,
            selector,
            before_try=identity.try_number,
            keep_finished=self.spec.keep_pods,
        )

    def _make_output_dir(self, job: SiteJob) -> None:
        # The kubelet creates a missing subPath directory owned by root, where the trainer (UID 1000)
        # could not write its update: create it first, as the store's owner.
        output = job.env.get(FLARE_OUTPUT)
        path = local_path(output) if output is not None and self.spec.store_mount is not None else None
        if path is not None:
            os.makedirs(posixpath.dirname(path), exist_ok=True)
