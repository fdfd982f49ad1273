"""The Kubernetes backend's sweep: pods a run's tries left behind."""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import Context

from flare_airflow.operators.common import (
    run_id_of,
)
from flare_airflow.operators.sweep import SweepOperator


class SweepPodsOperator(SweepOperator):
    """Delete every pod still labelled with this run in the namespaces of the job's k8s sites.

    The builder adds it as the run's teardown (for jobs with Kubernetes sites): it runs when every
    other task has finished, also when a round failed and ``publish`` did not run, and its own
    outcome does not change the run's. Such a pod belongs to a try whose worker was killed (the
    try after it deletes it; the last try has no one after it). Best effort: a cluster that cannot
    be reached is logged. A site that keeps pods for debugging keeps the finished ones.
    """

    sweep_doc = "Delete pods this run left behind."

    def execute(self, context: Context) -> list[str]:
        deleted = self.sweep_site_pods(context)
        self.sweep_links_staging(context)
        return deleted

    def sweep_links_staging(self, context: Context) -> list[str]:
        """The shared links folders of this run's pod sites (a try killed outright left its own):
        removed, as this worker sees the site's ``store_mount``. Returns the folders removed."""
        from flare_airflow.operators.links import sweep_staging

        removed: list[str] = []
        for site, spec in self.swept_sites().items():
            mount = spec.launcher_spec.k8s.store_mount
            if mount is None:
                continue
            try:
                folders = sweep_staging(Path(mount.worker_path), self.job.job, run_id_of(context), site)
            except (OSError, ValueError) as exc:
                self.log.warning("could not sweep site %s's links staging folder: %s", site, exc)
                continue
            removed += [str(f) for f in folders]
        if removed:
            self.log.warning("removed links staging this run's killed tries left: %s", ", ".join(removed))
        return removed

    def sweep_site_pods(self, context: Context) -> list[str]:
        """The pods deleted, as ``namespace/name``."""
        specs = [s.launcher_spec.k8s for s in self.swept_sites().values()]
        if not specs:
            return []
        from flare_airflow.hooks.kubernetes import site_hook
        from flare_airflow.launchers.kubernetes import delete_site_pods, site_pods_selector

        selector = site_pods_selector(self.job.job, run_id_of(context))
        deleted: list[str] = []
        places = {
            (s.kubernetes_conn_id, s.in_cluster, s.config_file, s.cluster_context, s.namespace, s.keep_pods): s
            for s in specs
        }
        for (*_cluster, namespace, keep_pods), spec in sorted(places.items(), key=lambda item: str(item[0])):
            try:
                found = delete_site_pods(site_hook(spec).core_v1_client, namespace, selector, keep_finished=keep_pods)
            except Exception as exc:  # the Kubernetes client raises many types; the run's result stands
                self.log.warning("could not sweep the pods of this run in namespace %s: %s", namespace, exc)
                continue
            deleted += [f"{namespace}/{name}" for name in found]
        if deleted:
            self.log.warning("deleted pods this run left running: %s", ", ".join(deleted))
        return deleted
