"""SitePodOperator without a cluster: deferrable mode follows Airflow's configuration, the worker's
site policy sets the pod's cluster, and a multi-node site job's group (operators/pod_group.py) is
named, created and deleted per try."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred
from kubernetes.client import models as k8s

from flare_airflow.operators.pod import SitePodOperator
from flare_airflow.operators.pod_group import create_other_ranks, delete_group_quietly, pod_group
from tests.unit.airflow_layer import FakeTI, context, make_job

REPO = pathlib.Path(__file__).resolve().parents[3]
BUILD = """
import json, sys
from flare_airflow.operators.pod import SitePodOperator
from tests.unit.airflow_layer import make_job
import pathlib
job = make_job(pathlib.Path(sys.argv[1]), sites=json.loads(sys.argv[2]), min_clients=1)
print(json.dumps([
    SitePodOperator(task_id="a", job=job, site="site-1", round_num=1).deferrable,
    SitePodOperator(task_id="b", job=job, site="site-1", round_num=1, deferrable=False).deferrable,
    SitePodOperator(task_id="c", job=job, site="site-1", round_num=1, deferrable=True).deferrable,
]))
"""


def pod_sites(tmp_path: pathlib.Path) -> dict:
    k8s = {"image": "img:1", "store_mount": {"host_path": str(tmp_path / "store"), "mount_path": "/s"}}
    return {"site-1": {"launcher": "k8s", "launcher_spec": {"k8s": k8s}}}


@pytest.mark.parametrize("configured", ["True", "False"])
def test_deferrable_follows_operators_default_deferrable_unless_the_dag_says(tmp_path, configured: str) -> None:
    # The setting is read when the operator's module is imported (as the cncf provider reads it):
    # a fresh interpreter per value.
    env = {**os.environ, "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": configured}
    out = subprocess.run(
        [sys.executable, "-c", BUILD, str(tmp_path), json.dumps(pod_sites(tmp_path))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    default, explicit_false, explicit_true = json.loads(out.stdout.strip().splitlines()[-1])
    assert default is (configured == "True")
    assert (explicit_false, explicit_true) == (False, True)


def test_the_triggers_grace_period_is_rounded_up_as_the_pods_own(tmp_path) -> None:
    # The manifest builder gives the pod terminationGracePeriodSeconds = ceil(shutdown_timeout);
    # a delete by the trigger must not give it less.
    trainer = {"script": "train.py", "shutdown_timeout": 2.2}
    job = make_job(tmp_path, sites=pod_sites(tmp_path), min_clients=1, trainer=trainer)
    op = SitePodOperator(task_id="a", job=job, site="site-1", round_num=1)
    op.pod = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="p", namespace="ns"))
    assert op._trigger(None).grace_period == 3


def test_the_stock_operators_deferral_is_the_lifecycles_resume_method_and_deadline(tmp_path) -> None:
    """The stock ``execute_async`` (and its re-defer after a watch error) defers through our
    ``invoke_defer_method``: it must be the lifecycle's own deferral -- resumed in the stock
    ``trigger_reentry``, timed out a minute after the execution deadline the trigger enforces."""
    job = make_job(tmp_path, sites=pod_sites(tmp_path), min_clients=1)
    op = SitePodOperator(task_id="a", job=job, site="site-1", round_num=1, execution_timeout=timedelta(hours=1))
    op.pod = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="p", namespace="ns"))
    ti = FakeTI()
    ti.start_date = datetime.now(tz=UTC)  # type: ignore[attr-defined]  # FakeTI has no start date
    with pytest.raises(TaskDeferred) as deferred:
        op.invoke_defer_method(context=context(ti))
    assert deferred.value.method_name == "trigger_reentry" == op.resume_method
    assert timedelta(minutes=60) < deferred.value.timeout <= timedelta(minutes=61)
    trigger = deferred.value.trigger
    assert (trigger.pod_name, trigger.pod_namespace) == ("p", "ns")
    assert trigger.execution_deadline == op.execution_deadline(context(ti))


def test_evaluate_needs_the_trainer_script_on_the_worker_even_when_every_site_is_a_pod(tmp_path) -> None:
    from flare_airflow.core.errors import ConfigError

    (tmp_path / "train.py").write_text("")
    kwargs = {"sites": pod_sites(tmp_path), "min_clients": 1, "trainer": {"script": "elsewhere/train.py"}}
    with pytest.raises(ConfigError, match=r"evaluate is true, so trainer.script 'elsewhere/train.py' runs on"):
        SitePodOperator(task_id="a", job=make_job(tmp_path, evaluate=True, **kwargs), site="site-1", round_num=1)
    # Without evaluation the worker never runs it: the pod's image holds the script.
    SitePodOperator(task_id="a", job=make_job(tmp_path, evaluate=False, **kwargs), site="site-1", round_num=1)


def test_the_workers_site_policy_sets_the_pods_cluster_namespace_and_image(tmp_path, monkeypatch) -> None:

    job = make_job(tmp_path, sites=pod_sites(tmp_path), min_clients=1, evaluate=False)
    op = SitePodOperator(task_id="a", job=job, site="site-1", round_num=1)
    assert (op.namespace, op.image, op.kubernetes_conn_id) == ("default", "img:1", None)
    mount = {"pvc": "site-store", "mount_path": "/s"}
    site = {"image": "site/img:2", "namespace": "site-ns", "kubernetes_conn_id": "site_k8s", "keep_pods": True}
    policy = {"sites": {"site-1": {"launcher": "k8s", "launcher_spec": {"k8s": {**site, "store_mount": mount}}}}}
    monkeypatch.setenv("AIRFLOW_VAR_FLARE_SITE_POLICY", json.dumps(policy))
    op.apply_site_policy(context())
    assert (op.namespace, op.image, op.kubernetes_conn_id) == ("site-ns", "site/img:2", "site_k8s")
    assert op.on_finish_action.value == "keep_pod" and not op._is_delete_operator_pod
    assert op.job.sites["site-1"].launcher_spec.k8s.store_mount.pvc == "site-store"
    assert job.sites["site-1"].launcher_spec.k8s.image == "img:1"  # the DAG's job is left as parsed


def test_a_site_policy_whose_pods_cannot_reach_the_store_fails_the_site_before_any_pod(tmp_path, monkeypatch) -> None:
    from flare_airflow.core.failure_record import read_failure
    from flare_airflow.operators.common import store_for
    from flare_airflow.operators.site_steps import SiteJobFailed
    from tests.unit.airflow_layer import RUN_ID

    job = make_job(tmp_path, sites=pod_sites(tmp_path), min_clients=1, evaluate=False)
    op = SitePodOperator(task_id="a", job=job, site="site-1", round_num=1)
    policy = {"sites": {"site-1": {"launcher": "k8s", "launcher_spec": {"k8s": {"image": "site/img:2"}}}}}
    monkeypatch.setenv("AIRFLOW_VAR_FLARE_SITE_POLICY", json.dumps(policy))
    with pytest.raises(
        SiteJobFailed, match=r"site policy on this worker\): the model store .* set launcher_spec.k8s.store_mount"
    ):
        op.apply_site_policy(context())
    failure = read_failure(store_for(job).site_update(job.job, RUN_ID, 1, "site-1")) or ""
    assert "store_mount" in failure and "[CONFIG_ERROR]" in failure
    assert op.image == "img:1"  # nothing of the refused policy was taken


# ---------------------------------------------------------------- the multi-node group (operators/pod_group.py)


def group_job(tmp_path: pathlib.Path, nodes: int, keep_pods: bool = False):
    sites = pod_sites(tmp_path)
    sites["site-1"]["launcher_spec"]["k8s"].update(nodes=nodes, keep_pods=keep_pods)
    return make_job(tmp_path, sites=sites, min_clients=1, evaluate=False)


class RecordingCore:
    """The CoreV1Api calls the group makes, recorded instead of sent."""

    def __init__(self) -> None:
        self.created: list[tuple[str, str, Any]] = []

    def create_namespaced_service(self, namespace: str, body: Any) -> None:
        self.created.append(("service", namespace, body))

    def create_namespaced_pod(self, namespace: str, body: Any) -> None:
        self.created.append(("pod", namespace, body))


def test_a_one_node_site_job_has_no_group_and_deleting_it_is_a_no_op(tmp_path) -> None:
    job = group_job(tmp_path, nodes=1)
    assert pod_group(job, "site-1", "run-1", 1, 1) is None
    delete_group_quietly(object(), job, "site-1", 1, None, logging.getLogger("t"))  # touches no client


def test_a_group_names_one_pod_per_node_per_try(tmp_path) -> None:
    job = group_job(tmp_path, nodes=3)
    first, second = pod_group(job, "site-1", "run-1", 2, 1), pod_group(job, "site-1", "run-1", 2, 2)
    assert first is not None and second is not None
    assert len(first.names) == 3 and len(set(first.names)) == 3
    assert not set(first.names) & set(second.names) and first.selector != second.selector  # tries apart
    # The operator's trigger watches exactly these pods.
    op = SitePodOperator(task_id="a", job=job, site="site-1", round_num=2)
    op._know_group(context())
    op.pod = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=op._group.names[0], namespace="default"))
    trigger = op._trigger(None)
    assert (trigger.group_selector, trigger.group_pods) == (op._group.selector, op._group.names)


def test_the_other_ranks_and_the_service_are_created_with_the_operators_labels(tmp_path) -> None:
    job = group_job(tmp_path, nodes=3)
    op = SitePodOperator(task_id="a", job=job, site="site-1", round_num=1)
    run = op.site_run(context())
    core = RecordingCore()
    create_other_ranks(
        core, job, "site-1", run, store_root=str(tmp_path / "store"), try_number=1, namespace="ns",
        labels={"airflow-task": "a"}, log=logging.getLogger("t"),
    )  # fmt: skip
    kinds = [kind for kind, _, _ in core.created]
    assert kinds == ["service", "pod", "pod"] and {ns for _, ns, _ in core.created} == {"ns"}
    group = pod_group(job, "site-1", run.run_id, 1, 1)
    assert group is not None
    assert [body.metadata.name for kind, _, body in core.created if kind == "pod"] == group.names[1:]
    assert all(body.metadata.labels["airflow-task"] == "a" for kind, _, body in core.created if kind == "pod")


def test_deleting_a_group_keeps_finished_pods_of_a_keeping_site_and_never_raises(tmp_path, monkeypatch, caplog) -> None:
    import flare_airflow.operators.pod_group as pod_group_module

    calls = []

    def fake_delete(client, namespace, selector, *, keep_finished):
        calls.append((namespace, selector, keep_finished))
        raise RuntimeError("apiserver unreachable")

    monkeypatch.setattr(pod_group_module, "delete_site_pods", fake_delete)
    job = group_job(tmp_path, nodes=2, keep_pods=True)
    group = pod_group(job, "site-1", "run-1", 1, 1)
    with caplog.at_level(logging.WARNING):
        delete_group_quietly(object(), job, "site-1", 1, group, logging.getLogger("t"))
    assert calls == [("default", group.selector, True)]
    assert f"could not delete the pods of {group.selector}: apiserver unreachable" in caplog.text
