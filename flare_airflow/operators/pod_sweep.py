"""The Kubernetes backend's sweep: pods a run's tries left behind."""

from __future__ import annotations

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
        return self.sweep_site_pods(context)

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
