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
from collections.abc import Mapping, Sequence
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
    JobStatus,
    LineSink,
    SiteJob,
    wait_by_polling,
)
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.kubernetes.api import (
    REQUEST_TIMEOUT,
    api_message,
    delete_pod,
    delete_service,
    delete_site_pods,
    list_site_pods,
    list_site_services,
    list_warning_events,
    retrying,
)
from flare_airflow.launchers.kubernetes.manifest import build_site_job
from flare_airflow.launchers.kubernetes.naming import (
    CONTAINER_NAME,
    group_name,
    node_pod_name,
    site_job_selector,
    site_pods_selector,
)
from flare_airflow.launchers.kubernetes.state import (
    map_pod_group,
    trainer_started,
)
from flare_airflow.launchers.kubernetes.storage import local_path
from flare_airflow.launchers.trainer import output_prefix

log = logging.getLogger(__name__)

_GONE_EXTRA_SECONDS = 30.0


class KubernetesJobHandle(JobHandleSpec):
    """Handle of one site job: its pod, or the pods (node-rank order) and headless Service of a
    multi-node site job. Every read goes through :func:`map_pod_group` (:func:`map_pod` per pod):
    one pod failing fails the whole site job, and every pod and the Service are deleted together."""

    def __init__(
        self,
        launcher: KubernetesLauncher,
        job: SiteJob,
        pod: k8s.V1Pod | Sequence[k8s.V1Pod],
        service: k8s.V1Service | None = None,
        group_selector: str | None = None,
    ) -> None:
        pods = [pod] if isinstance(pod, k8s.V1Pod) else list(pod)
        self.launcher = launcher
        self.job = job
        self.names: list[str] = [p.metadata.name for p in pods]
        self.uids: dict[str, str | None] = {p.metadata.name: p.metadata.uid for p in pods}
        self.name: str = self.names[0]  # rank 0's pod
        self.namespace: str = pods[0].metadata.namespace
        self.uid: str | None = pods[0].metadata.uid
        self.service_name: str | None = service.metadata.name if service is not None else None
        self.service_uid: str | None = service.metadata.uid if service is not None else None
        # A multi-node site job: the label selector of its pods and Service (what a watch follows).
        self.group_selector = group_selector if len(self.names) > 1 else None
        self._status = JobStatus(JobState.STARTING, JobReturnCode.UNKNOWN, "", done=False)
        self._final: JobStatus | None = None
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
    def status(self) -> JobStatus:
        """The last :class:`JobStatus` seen (``waiting_for_resources`` and the scheduler's message while Pending)."""
        return self._final or self._status

    def _read_pod(self, name: str) -> k8s.V1Pod | None:
        def read() -> k8s.V1Pod | None:
            try:
                return self._core.read_namespaced_pod(name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        pod = retrying(read)
        uid = self.uids.get(name)
        if pod is not None and uid is not None and pod.metadata.uid != uid:
            return None  # a different pod under our name: ours is gone
        return pod

    def _read(self) -> k8s.V1Pod | None:
        return self._read_pod(self.name)

    def _read_all(self) -> list[tuple[str, k8s.V1Pod | None]]:
        return [(name, self._read_pod(name)) for name in self.names]

    def _warning_events(self, pod: k8s.V1Pod) -> list[Any]:
        return list_warning_events(self._core, self.namespace, pod)

    def poll(self) -> JobReturnCode:
        with self._lock:
            if self._final is not None:
                return self._final.return_code
            pods = self._read_all()
            events = {name: self._warning_events(pod) for name, pod in pods if pod is not None}
            spec = self._spec
            group = map_pod_group(
                pods,
                now=datetime.now(UTC),
                pending_timeout=spec.pending_timeout,
                startup_timeout=spec.startup_timeout,
                events=events,
            )
            self._status = group.status
            if group.status.done:
                self._finish(pods, group.status)
            return group.status.return_code

    @property
    def state(self) -> JobState:
        return self.status.state

    @property
    def reason(self) -> str:
        status = self.status
        return status.reason if status.done else ""

    def wait(self, timeout: float | None = None) -> JobReturnCode:
        return wait_by_polling(self.poll, lambda: self._final is not None, self._spec.poll_interval, timeout)

    def where(self) -> dict[str, Any]:
        return {"backend": "k8s", "namespace": self.namespace, "pod": self.name}

    def logs(self) -> str:
        """The trainer container's log (kept after the pod is deleted; empty if it never started);
        of a multi-node site job, every pod's log, each under a ``--- node rank R (pod NAME) ---`` line."""
        with self._lock:
            if self._logs is not None:
                return self._logs
            return self._join({name: self._read_logs(name) for name in self.names})

    def _join(self, logs: Mapping[str, str]) -> str:
        if len(self.names) == 1:
            return logs.get(self.name, "")
        return "".join(
            f"--- node rank {rank} (pod {name}) ---\n{logs[name]}"
            for rank, name in enumerate(self.names)
            if logs.get(name)
        )

    def _read_logs(self, name: str) -> str:
        def read() -> str:
            try:
                # kubernetes 36 mangles the decoded body (str(bytes)); read the raw response.
                resp = self._core.read_namespaced_pod_log(
                    name,
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

    def _collect_logs(self, pods: Sequence[tuple[str, k8s.V1Pod | None]]) -> None:
        self._logs = ""
        logs: dict[str, str] = {}
        for name, pod in pods:
            if not trainer_started(pod):
                continue
            try:
                logs[name] = self._read_logs(name)
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                # A missing log must not keep the pod alive: note it and go on deleting.
                log.warning("%s: cannot read the log of pod %s/%s: %s", self.job.label, self.namespace, name, exc)
        self._logs = self._join(logs)
        if self.launcher.sink is not None:
            prefix = output_prefix(self.job)
            for rank, name in enumerate(self.names):
                node = f"(node {rank}) " if len(self.names) > 1 else ""
                for line in logs.get(name, "").splitlines():
                    self.launcher.sink(prefix + node + line)

    def _finish(self, pods: Sequence[tuple[str, k8s.V1Pod | None]], status: JobStatus) -> None:
        self._final = status
        try:
            self._collect_logs(pods)
        finally:
            if all(pod is None for _name, pod in pods) and self.service_name is None:
                pass  # nothing of this site job is left to delete
            elif not self._spec.keep_pods:
                self._delete(grace=None)
            elif len(self.names) > 1:
                # A failed group's other pods may still run: keep only what finished, and the Service goes.
                self._delete(grace=None, keep_finished=True)

    def _delete(self, grace: int | None, keep_finished: bool = False) -> None:
        if self._deleted:
            return

        doomed = []
        for name in self.names:
            if keep_finished:
                pod = self._read_pod(name)
                if pod is None or (pod.status is not None and pod.status.phase in ("Succeeded", "Failed")):
                    continue
            delete_pod(self._core, self.namespace, name, grace=grace, uid=self.uids.get(name))
            doomed.append(name)
        if self.service_name is not None:
            delete_service(self._core, self.namespace, self.service_name, self.service_uid)
        limit = (grace if grace is not None else math.ceil(self.job.shutdown_timeout)) + _GONE_EXTRA_SECONDS
        deadline = time.monotonic() + limit
        for name in doomed:
            while self._read_pod(name) is not None:
                if time.monotonic() >= deadline:
                    raise LaunchError(
                        f"{self.job.label}: pod {self.namespace}/{name} still exists {limit:g}s after its deletion"
                    )
                time.sleep(0.2)
        self._deleted = True

    def terminate(self) -> None:
        """Delete the pod(s) (grace = the job's shutdown timeout) and wait until they are gone. Idempotent.

        A site job that already finished keeps its result (success stays success) and, with
        ``keep_pods``, its pods.
        """
        with self._lock:
            if self._final is not None:
                if not self._spec.keep_pods:
                    self._delete(grace=None)
                return
            pods = self._read_all()
            group = map_pod_group(pods, now=datetime.now(UTC), pending_timeout=math.inf, startup_timeout=math.inf)
            if group.status.done:
                self._status = group.status
                self._finish(pods, group.status)
                return
            what = "pod deleted" if len(self.names) == 1 else "pods deleted"
            self._final = JobStatus(
                JobState.TERMINATED, JobReturnCode.ABORTED, f"terminated: {what} on request", done=True
            )
            try:
                self._collect_logs(pods)
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
        objects = build_site_job(job_meta, self.spec, self.resources, store_root=self.store_root, try_number=try_number)
        self._make_output_dir(job_meta)
        service = None
        created: list[k8s.V1Pod] = []
        try:
            if objects.service is not None:
                service = self._create(job_meta, "Service", objects.service, self.core.create_namespaced_service)
            for pod in objects.pods:
                created.append(self._create(job_meta, "pod", pod, self.core.create_namespaced_pod))
        except BaseException:
            # Half a group never runs: what was created goes again.
            if service is not None or created:
                KubernetesJobHandle(self, job_meta, created or list(objects.pods[:1]), service)._delete(grace=0)
            raise
        selector = site_job_selector(JobIdentity.of(job_meta, try_number))
        return KubernetesJobHandle(self, job_meta, created, service, selector)

    def _create(self, job_meta: SiteJob, kind: str, body: Any, create: Any) -> Any:
        try:
            return create(self.spec.namespace, body, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as exc:
            what = {409: f"a {kind} with this name already exists", 422: f"the API refused the {kind}"}.get(
                exc.status or 0, f"creating the {kind} failed (HTTP {exc.status})"
            )
            raise LaunchError(
                f"{job_meta.label}: {what}: {body.metadata.namespace}/{body.metadata.name}: {api_message(exc)}"
            ) from exc

    def find_job(self, identity: JobIdentity, *, shutdown_timeout: float = 10.0) -> KubernetesJobHandle | None:
        """The handle of the pod launched under ``identity`` (found by its labels in the site's
        namespace, whoever created it), or ``None`` when no such pod exists (never created, or
        deleted once it finished). Polling the handle maps the pod as a fresh launch would; a
        finished pod gives its result (and is deleted unless the site keeps pods)."""
        selector = site_job_selector(identity)
        pods = list_site_pods(self.core, self.spec.namespace, selector)
        if not pods:
            return None
        site_job = identity.site_job(shutdown_timeout)
        if self.spec.nodes <= 1:
            return KubernetesJobHandle(self, site_job, min(pods, key=lambda p: str(p.metadata.name)))
        # A multi-node site job: every rank's pod (one missing counts as vanished) and its Service.
        group = group_name(
            identity.job, identity.site, identity.round, identity.run_id, identity.try_number, self.spec.nodes
        )
        by_name = {p.metadata.name: p for p in pods}
        members = [
            by_name.get(name) or k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, namespace=self.spec.namespace))
            for name in (node_pod_name(group, rank) for rank in range(self.spec.nodes))
        ]
        service = next(iter(list_site_services(self.core, self.spec.namespace, selector)), None)
        return KubernetesJobHandle(self, site_job, members, service, selector)

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
