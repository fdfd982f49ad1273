"""Site job task for Kubernetes sites: a ``KubernetesPodOperator`` whose pod comes from the one
manifest builder (:func:`flare_airflow.launchers.kubernetes.job_pod`) and whose waiting follows
NVIDIA FLARE's launcher semantics (:class:`flare_airflow.triggers.pod_state.PodStateTrigger`).

Deferrable when ``[operators] default_deferrable`` says so (as every cncf operator), or when the
DAG author passes ``deferrable=``. Sync mode runs the same trigger in the worker, so both modes share one
state table. However the task ends -- success, failure, timeout, kill, "mark failed" -- the pod is
deleted unless the site keeps pods for debugging; the task log carries the pod's log and the reason.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.utils.pod_manager import OnFinishAction
from airflow.providers.common.compat.sdk import conf
from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowSkipException, TaskDeferred
from kubernetes.client import models as k8s

from flare_airflow.core.config import JobConfig, KubernetesLaunchSpec
from flare_airflow.core.errors import ConfigError, FlareAirflowError
from flare_airflow.core.spec import JobIdentity, JobLauncherSpec, JobReturnCode
from flare_airflow.hooks.kubernetes import site_hook
from flare_airflow.launchers.kubernetes import (
    CONTAINER_NAME,
    KubernetesLauncher,
    delete_pod,
    delete_site_pods,
    job_pod,
    site_pods_selector,
    unreachable_store,
)
from flare_airflow.operators.common import store_for
from flare_airflow.operators.lifecycle import SiteTaskLifecycle
from flare_airflow.operators.pod_group import PodGroup, create_other_ranks, delete_group_quietly, pod_group
from flare_airflow.operators.site_steps import (
    job_at_site,
    site_config_failed,
)
from flare_airflow.site_task.spec import SiteRun
from flare_airflow.triggers.pod_state import PodStateTrigger

if TYPE_CHECKING:
    from airflow.triggers.base import BaseTrigger


def pod_settings(spec: KubernetesLaunchSpec) -> dict[str, Any]:
    """The stock operator's arguments that come from a site's ``launcher_spec.k8s``: its cluster,
    namespace, image and what happens to a finished pod."""
    return {
        "namespace": spec.namespace,
        "image": spec.image,
        "kubernetes_conn_id": spec.kubernetes_conn_id,
        "in_cluster": spec.in_cluster,
        "config_file": spec.config_file,
        "cluster_context": spec.cluster_context,
        "on_finish_action": "keep_pod" if spec.keep_pods else "delete_pod",
        "poll_interval": spec.poll_interval,
    }


def kubernetes_launcher(
    job: JobConfig, site: str, *, try_number: int, sink: Callable[[str], None] | None, hidden: Sequence[str]
) -> KubernetesLauncher:
    """A Kubernetes site's launcher: its cluster through the site's Airflow connection (``KubernetesHook``)."""
    spec = job.sites[site]
    return KubernetesLauncher(
        spec.launcher_spec.k8s,
        spec.resource_spec,
        store_root=str(store_for(job).root),
        api_client=site_hook(spec.launcher_spec.k8s).api_client,
        try_number=try_number,
        sink=sink,
    )


def pod_trigger(job: JobConfig, site: str, handle: Any, round_num: int) -> PodStateTrigger:
    """A Kubernetes site job's deferrable watch for the sensor: the fused pod task's own trigger."""
    return PodStateTrigger.for_site(
        job.sites[site].launcher_spec.k8s,
        pod_name=handle.name,
        pod_namespace=handle.namespace,
        delete_on_kill=False,  # the sensor does not own the pod: a later try re-attaches
        # a multi-node site job: every pod of the launch, watched as one
        group_selector=handle.group_selector,
        group_pods=handle.names if handle.group_selector else None,
    )


class SitePodOperator(SiteTaskLifecycle[k8s.V1Pod], KubernetesPodOperator):
    """Train one site for one round as a pod in the site's cluster.

    :param job: the validated job.
    :param site: the site (its launcher is ``k8s``).
    :param round_num: the round, 1-based; rounds beyond the run's ``rounds`` are skipped.
    :param global_task_id: the task whose XCom names the input global model's sha256 (set by the builder).
    :param deferrable: wait in the triggerer (``True``) or in the worker; by default what
        ``[operators] default_deferrable`` says, read as the cncf provider reads it.

    Returns (XCom) the update's URI, sha256, sample count and metrics; never weights.
    """

    ui_color = "#c7e9c0"
    # The pod reaches the store itself (a store_mount, or an object store with the pod's own
    # credentials): a copy staged on this worker would hand the pod paths that exist only here.
    stages_store = False
    # With the round's store links (strict mode: no store credential at the site), this worker
    # stages through them into the site's store_mount, which it shares with the pod; the pod then
    # holds no key and no link (no native sidecars on k8s 1.20: a key in the pod would be the
    # trainer's, who could write its slot past the checks and privacy filters).
    stages_links_in_shared_folder = True
    # The stock operator re-enters (and re-defers) by this name: the lifecycle's resume.
    resume_method = "trigger_reentry"
    # The Rendered Templates tab: which site job this is, and where its pod runs. Of the stock
    # operator's fields only those this operator really uses are kept; the others are either
    # unused here (the pod comes from the manifest builder, so cmds, arguments, labels,
    # annotations, hostname, name, volumes, volume_mounts, container_resources, node_selector and
    # pod_template_file would show empty values that are not what the pod runs) or could render
    # secret material (env_vars and pod_template_dict may hold literal values; env_from and
    # configmaps name secret sources) or internal state (trigger_kwargs). The pod's environment,
    # secret references included, is built per try and never rendered.
    template_fields: Sequence[str] = (
        *SiteTaskLifecycle.site_template_fields,
        "image",
        "namespace",
        "kubernetes_conn_id",
        "cluster_context",
        "config_file",
        "base_container_name",
    )

    def __init__(
        self,
        *,
        job: JobConfig,
        site: str,
        round_num: int,
        global_task_id: str | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        spec = job.sites[site].launcher_spec.k8s
        problem = unreachable_store(spec, str(store_for(job).root))
        if problem is not None:
            # At parse time: the DAG shows an import error instead of every round failing.
            raise ConfigError(f"site {site!r}: {problem}")
        if job.evaluate and not job.script_path().is_file():
            # The job's validation checks the script only for process sites; evaluation runs it on
            # the worker whatever the sites' backend (the global model is the server's, not a site's).
            raise ConfigError(
                f"evaluate is true, so trainer.script {job.trainer.script!r} runs on the Airflow worker after "
                f"each round, but it does not exist there (looked at {job.script_path()}); make it available "
                "on the worker (paths are relative to the job file) or set evaluate: false"
            )
        super().__init__(
            job=job,
            site=site,
            round_num=round_num,
            global_task_id=global_task_id,
            **pod_settings(spec),
            base_container_name=CONTAINER_NAME,
            get_logs=True,
            do_xcom_push=False,
            reattach_on_restart=False,
            log_events_on_failure=True,
            deferrable=deferrable,
            **kwargs,
        )
        self._policy_applied = False
        # A multi-node site job (nodes > 1): this try's group of pods and Service.
        self._group: PodGroup | None = None

    def apply_site_policy(self, context: Context) -> None:
        """Run the pod as this worker's site policy says (cluster, namespace, image, volumes, store).

        The stock operator's cluster and pod fields were set from the job when the DAG was parsed;
        a policy on the worker replaces them here, before any client, pod or trigger is made. Called
        again when a deferred task resumes (a new process that parsed the DAG afresh).
        """
        if self._policy_applied:
            return
        job = job_at_site(self.job, self.site, context, self.round_num)
        self._policy_applied = True
        if job is self.job:
            return
        spec = job.sites[self.site].launcher_spec.k8s
        problem = unreachable_store(spec, str(store_for(job).root))
        if problem is not None:
            reason = f"site {self.site!r} (site policy on this worker): {problem}"
            raise site_config_failed(context, job, self.site, self.round_num, reason)
        self.job = job
        self._run = None
        for name, value in pod_settings(spec).items():
            setattr(self, name, OnFinishAction(value) if name == "on_finish_action" else value)
        self._is_delete_operator_pod = self.on_finish_action == OnFinishAction.DELETE_POD

    def argv(self) -> list[str]:
        return []  # the pod's command comes from the manifest builder (the site's image)

    def links_folder(self) -> pathlib.Path:
        """The site's ``store_mount`` as this worker sees it: its host path (the worker runs on a
        node that has it), or the PVC's ``mount_path`` (the worker mounts the PVC at that path too)."""
        mount = self.job.sites[self.site].launcher_spec.k8s.store_mount
        if mount is None:
            raise ConfigError(
                f"site {self.site!r} round {self.round_num}: this site reaches the model store only through its "
                "round's store links (strict mode: it holds no store credential), which its worker opens and stages "
                "for the pod in a folder both see; set launcher_spec.k8s.store_mount (a host_path on the worker's "
                "node, or a PVC the worker mounts at the same mount_path), or give the site its own store "
                "connection and no box key in the registry"
            )
        return pathlib.Path(mount.worker_path)

    def pod_run(self, context: Context) -> tuple[SiteRun, str]:
        """The run as the pod sees it and its store root: staged in the shared folder, or the store's own."""
        if self._shared is not None:
            return self._shared.local, str(self._shared.mount)
        return self.site_run(context), str(store_for(self.job).root)

    def build_pod_request_obj(self, context: Context | None = None, *, dry_run: bool = False) -> Any:
        if context is None:
            raise FlareAirflowError("a site pod is built for one task instance: a context is needed")
        run, store_root = self.pod_run(context)
        try:
            pod = job_pod(
                self.job,
                self.site,
                run.site_job(),
                store_root=store_root,
                try_number=int(context["ti"].try_number or 1),
            )
        except FlareAirflowError as exc:  # site policy refused the pod (host paths, store): no pod exists
            raise self.fail(context, run, JobReturnCode.CONFIG_ERROR, str(exc)) from None
        # The operator's own identifying labels too, so that Airflow's tooling finds the pod.
        pod.metadata.labels.update(self._get_ti_pod_labels(context))
        return pod

    def _know_group(self, context: Context) -> None:
        """Name this try's group of pods (nodes > 1) so that every exit path can delete it."""
        run = self.site_run(context)
        self._group = pod_group(self.job, self.site, run.run_id, self.round_num, int(context["ti"].try_number or 1))

    def get_or_create_pod(self, pod_request_obj: k8s.V1Pod, context: Context) -> k8s.V1Pod:
        """Rank 0's pod, as the stock operator creates it; for several nodes the headless Service and
        the other ranks' pods first."""
        if self._group is not None:
            run, store_root = self.pod_run(context)
            create_other_ranks(
                self.client,
                self.job,
                self.site,
                run,
                store_root=store_root,
                try_number=int(context["ti"].try_number or 1),
                namespace=pod_request_obj.metadata.namespace,
                labels=self._get_ti_pod_labels(context),
                log=self.log,
            )
        return super().get_or_create_pod(pod_request_obj, context)

    def _delete_group_quietly(self) -> None:
        delete_group_quietly(self.client, self.job, self.site, self.round_num, self._group, self.log)

    def on_kill(self) -> None:
        KubernetesPodOperator.on_kill(self)  # deletes the pod it created
        self._delete_group_quietly()
        self.end_shared_on_kill()

    # ------------------------------------------------------------------ the lifecycle's hooks

    def launcher(self, *, try_number: int, secrets: Mapping[str, str]) -> JobLauncherSpec | None:
        return None  # the stock operator creates and watches the pod (its client, logs and labels)

    def end_earlier_tries(
        self, *, context: Context, launcher: JobLauncherSpec | None, identity: JobIdentity
    ) -> list[str]:
        return self.delete_earlier_tries(context)

    def launch(
        self,
        *,
        context: Context,
        run: SiteRun,
        launcher: JobLauncherSpec | None,
        try_number: int,
        secrets: Mapping[str, str],
    ) -> k8s.V1Pod:
        """Create the pod (for several nodes, the group first) as the stock operator does."""
        self._know_group(context)
        self.name = self._set_name(self.name)
        try:
            self.pod_request_obj = self.build_pod_request_obj(context)
            self.pod = self.get_or_create_pod(pod_request_obj=self.pod_request_obj, context=context)
        except BaseException:
            self._delete_pod_quietly()  # a group's pods may exist already
            raise
        return self.pod

    def trigger(self, *, context: Context, run: SiteRun, handle: k8s.V1Pod) -> PodStateTrigger:
        return self._trigger(context)

    def defer_watch(self, *, context: Context, trigger: BaseTrigger) -> None:
        """The stock ``execute_async``: it records the pod in XCom (Airflow's own tooling reads it)
        and calls our :meth:`invoke_defer_method`, or resumes at once when the pod already ended."""
        self.execute_async(context)

    def end_job(self, handle: k8s.V1Pod) -> None:
        self._delete_pod_quietly()

    def end_watched_job(self, event: dict[str, Any]) -> None:
        """The pod an event names, when the resumed task cannot go on to the stock re-entry (which deletes it)."""
        self._delete_pod_quietly(event)

    def delete_earlier_tries(self, context: Context) -> list[str]:
        """Delete the pods of this site job's earlier tries (found by their labels) before this try
        creates its own: a try whose worker was killed left its pod running, unwatched.

        A site that keeps pods for debugging keeps the finished ones.
        """
        run = self.site_run(context)
        try_number = int(context["ti"].try_number or 1)
        if try_number <= 1:
            return []
        spec = self.job.sites[self.site].launcher_spec.k8s
        selector = site_pods_selector(self.job.job, run.run_id, self.round_num, self.site)
        deleted = delete_site_pods(
            self.client, spec.namespace, selector, before_try=try_number, keep_finished=spec.keep_pods
        )
        if deleted:
            self.log.info(
                "site %s round %d try %d: deleted the pods of earlier tries in %s: %s",
                self.site,
                self.round_num,
                try_number,
                spec.namespace,
                ", ".join(deleted),
            )
        return deleted

    def _trigger(self, context: Context | None) -> PodStateTrigger:
        spec = self.job.sites[self.site].launcher_spec.k8s
        assert self.pod is not None
        return PodStateTrigger.for_site(
            spec,
            pod_name=self.pod.metadata.name,
            pod_namespace=self.pod.metadata.namespace,
            # The trigger enforces execution_timeout itself and deletes the pod: Airflow's own
            # timeout of a deferred task would fail it without any chance to clean up.
            execution_deadline=self.execution_deadline(context),
            grace_period=math.ceil(self.job.trainer.shutdown_timeout),  # as the pod's own grace period
            delete_on_kill=not spec.keep_pods,
            redefer_count=int((self.trigger_kwargs or {}).get("_redefer_count", 0)),
            group_selector=self._group.selector if self._group else None,
            group_pods=self._group.names if self._group else None,
        )

    def invoke_defer_method(self, last_log_time: Any = None, context: Context | None = None) -> None:
        """The stock operator defers (and re-defers after a watch error) through here: the lifecycle's
        own deferral (its resume method and deadline), with this try's trigger."""
        if context is None:
            raise FlareAirflowError("a site pod is watched for one task instance: a context is needed")
        SiteTaskLifecycle.defer_watch(self, context=context, trigger=self._trigger(context))

    def _delete_pod_quietly(self, event: dict[str, Any] | None = None) -> None:
        """Delete this try's pod (a 404 counts as done); ``event`` names it when ``self.pod`` is unset.
        Of a multi-node site job, every pod and the Service."""
        self._delete_group_quietly()
        if self.job.sites[self.site].launcher_spec.k8s.keep_pods:
            return
        pod: Any = self.pod
        if pod is None and event and event.get("name") and event.get("namespace"):
            pod = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=event["name"], namespace=event["namespace"]))
        if pod is None:
            return
        try:
            delete_pod(self.client, pod.metadata.namespace, pod.metadata.name, grace=None, uid=pod.metadata.uid)
        except Exception as exc:  # the original error matters more; say why the pod may remain
            self.log.warning("could not delete pod %s: %s", pod.metadata.name, exc)

    def trigger_reentry(self, context: Context, event: dict[str, Any]) -> Any:
        return self.resume(context, event)

    def on_event(self, *, context: Context, run: SiteRun, event: dict[str, Any]) -> dict[str, Any]:
        """The stock ``trigger_reentry`` reads the pod's log and deletes it; then accept or fail."""
        self._know_group(context)
        if self.pod is not None:  # a watch lost in the worker names no pod
            event = {"name": self.pod.metadata.name, "namespace": self.pod.metadata.namespace, **event}
        reason = str(event.get("reason") or event.get("message") or event.get("status"))
        self.log.info("site %s round %d pod %s: %s", self.site, self.round_num, event.get("name"), event.get("status"))
        if event.get("status") == "error" and int(event.get("_redefer_count", 0)) >= self.MAX_REDEFER_ATTEMPTS:
            # The watch kept failing: stop here and delete the pod (as for a timeout) rather than
            # wait for it in the worker; the stock operator re-defers before that.
            event = {**event, "status": "timeout"}
        if event.get("status") == "timeout":
            # The container never ran (pending, image or config error) or the trigger already
            # deleted it (execution timeout): there is no log to read, only the reason.
            self.get_logs = False
        try:
            KubernetesPodOperator.trigger_reentry(self, context, event)
        except (AirflowSkipException, TaskDeferred):
            raise
        except Exception as exc:  # the stock operator raises several types; each ends this site job
            # It deletes the pod in its own ``finally`` only once it could read the pod again: when
            # that read failed (API unreachable from the worker, self.pod unset), delete by the event's name.
            if self.pod is None:
                self._delete_pod_quietly(event)
            if event.get("status") == "success":
                reason = f"pod succeeded but its result could not be collected: {exc}"
            self._delete_group_quietly()
            rc = JobReturnCode(int(event.get("return_code", int(JobReturnCode.EXECUTION_ERROR))))
            raise self.fail(context, run, rc, reason) from None
        self._delete_group_quietly()  # the stock operator deleted the pod it re-read (rank 0) only
        # do_xcom_push is the stock operator's sidecar switch (off): finish pushes the summary.
        return self.finish(context, run, JobReturnCode.SUCCESS)
