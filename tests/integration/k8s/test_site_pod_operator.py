"""SitePodOperator and its pod-state trigger against the real control plane (the LOCAL NODE AGENT
test harness plays the kubelet). The operator runs as Airflow runs a deferrable task: ``execute``
defers, the trigger runs until its event, ``trigger_reentry`` finishes the task."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from airflow.sdk.exceptions import TaskDeferred
from kubernetes import client as k8s
from safetensors.numpy import load, load_file

from flare_airflow.core.config import job_from_dict
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.store import ModelStore, failure_path, record_path
from flare_airflow.operators.links import LINKS_KEY, LINKS_STAGING_DIR, mint_round_links
from flare_airflow.operators.pod import SitePodOperator
from flare_airflow.operators.site_steps import SiteJobFailed
from flare_airflow.operators.trust import sign_global
from flare_airflow_testing.harness import tiny_model
from flare_airflow_testing.k8s.audit import summarize
from flare_airflow_testing.k8s.kube import python_pod, wait_for
from flare_airflow_testing.s3_server import BUCKET
from tests.integration.store.test_store_links import Log, get, put_model

TRAINER = pathlib.Path(__file__).parents[1] / "trainers" / "k8s_trainer.py"
RUN_ID = "manual__2026-11-30T00:00:00+00:00"


def make_op(tmp_path: pathlib.Path, namespace: str, kubeconfig: pathlib.Path, *, gpus: int = 0, args=(), **k8s_extra):
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    site = {
        "launcher": "k8s",
        "launcher_spec": {
            "k8s": {
                "image": "registry.example/flare/trainer:1",
                "namespace": namespace,
                "config_file": str(kubeconfig),
                "store_mount": {"host_path": str(store), "mount_path": "/flare-store"},
                "trainer_command": [sys.executable],
                "trainer_script": str(TRAINER),
                "poll_interval": 1,
                **k8s_extra,
            }
        },
    }
    if gpus:
        site["resource_spec"] = {"num_of_gpus": gpus}
        site["resource_manager"] = {"type": "passthrough"}
    job = job_from_dict(
        {
            "job": "podjob",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(tiny_model(tmp_path / "init.safetensors")),
            "store": f"file://{store}",
            "trainer": {"script": str(TRAINER), "args": list(args), "shutdown_timeout": 2},
            "sites": {"site-1": site},
        }
    )
    write_artifact(
        ModelStore(store).global_model("podjob", RUN_ID, 0),
        FLModel(params={"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}),
    )
    # Deferrable as the tests run it (run_deferred); the default follows [operators] default_deferrable.
    return SitePodOperator(task_id="site-1", job=job, site="site-1", round_num=1, deferrable=True), store


def context_for(op: SitePodOperator) -> dict[str, Any]:
    ti = SimpleNamespace(
        dag_id="podjob_dag",
        task_id=op.task_id,
        map_index=-1,
        try_number=1,
        start_date=datetime.now(UTC),
        xcom_push=lambda *a, **k: None,
    )
    return {"ti": ti, "task_instance": ti, "run_id": RUN_ID, "dag": SimpleNamespace(dag_id="podjob_dag"), "params": {}}


def run_deferred(op: SitePodOperator, context: dict[str, Any]) -> Any:
    """What Airflow does with a deferrable task: execute, run the trigger to its event, re-enter."""
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    trigger = deferred.value.trigger
    assert trigger.serialize()[0] == "flare_airflow.triggers.pod_state.PodStateTrigger"

    async def first_event() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    event = asyncio.run(first_event())
    return getattr(op, deferred.value.method_name)(context, event)


def pods(core: k8s.CoreV1Api, namespace: str) -> list[str]:
    return [p.metadata.name for p in core.list_namespaced_pod(namespace).items]


def test_a_site_pod_trains_and_returns_the_update(tmp_path, control_plane, node_agent, namespace, core, audit) -> None:
    op, store = make_op(tmp_path, namespace, control_plane.kubeconfig)
    mark = audit.mark()
    summary = run_deferred(op, context_for(op))
    assert summary["site"] == "site-1" and summary["num_samples"] == 7
    update = load_file(str(ModelStore(store).site_update("podjob", RUN_ID, 1, "site-1")))
    np.testing.assert_array_equal(update["w"], np.ones(4, np.float32))
    assert pods(core, namespace) == []
    audit.settle()
    counts = summarize(audit.client_requests(namespace, since=mark))
    print(f"\nAPI requests of one site pod task (deferrable): {counts}")


def test_image_pull_error_fails_within_30s_with_the_reason_and_deletes_the_pod(
    tmp_path, control_plane, node_agent, namespace, core
) -> None:
    op, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, image="registry.example/flare/pull-error:1")
    started = time.monotonic()
    with pytest.raises(SiteJobFailed, match=r"ErrImagePull|ImagePullBackOff"):
        run_deferred(op, context_for(op))
    assert time.monotonic() - started < 30
    wait_for(lambda: pods(core, namespace) == [], 30, what="the failed pod is deleted")


def _blockers(core: k8s.CoreV1Api, namespace: str, seconds: list[float]) -> list[str]:
    names = []
    for i, secs in enumerate(seconds):
        name = f"gpu-blocker-{i}"
        body = python_pod(
            name,
            f"import time; time.sleep({secs})",
            sys.executable,
            resources={"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}},
        )
        core.create_namespaced_pod(namespace, body)
        names.append(name)
    wait_for(
        lambda: all((core.read_namespaced_pod(n, namespace).status.phase or "") == "Running" for n in names),
        30,
        what="four GPU blockers running",
    )
    return names


def _cleanup(core: k8s.CoreV1Api, namespace: str, names: list[str]) -> None:
    for name in names:
        try:
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except k8s.ApiException as exc:
            if exc.status != 404:
                raise
    wait_for(lambda: pods(core, namespace) == [], 30, what="blockers gone")


def test_fifth_gpu_job_fails_after_pending_timeout_with_the_scheduler_reason(
    tmp_path, control_plane, node_agent, namespace, core
) -> None:
    blockers = _blockers(core, namespace, [600, 600, 600, 600])
    try:
        op, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, gpus=1, pending_timeout=4)
        started = time.monotonic()
        with pytest.raises(SiteJobFailed, match=r"Insufficient nvidia.com/gpu"):
            run_deferred(op, context_for(op))
        assert 3 <= time.monotonic() - started < 30
        assert sorted(pods(core, namespace)) == blockers, "the pending site pod is deleted"
    finally:
        _cleanup(core, namespace, blockers)


def test_fifth_gpu_job_waits_and_runs_when_a_gpu_frees(tmp_path, control_plane, node_agent, namespace, core) -> None:
    blockers = _blockers(core, namespace, [6, 600, 600, 600])
    try:
        op, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, gpus=1, pending_timeout=60)
        started = time.monotonic()
        summary = run_deferred(op, context_for(op))
        assert summary["num_samples"] == 7
        assert time.monotonic() - started >= 3, "it had to wait for a GPU"
    finally:
        _cleanup(core, namespace, blockers)


def test_execution_timeout_deletes_the_pod(tmp_path, control_plane, node_agent, namespace, core) -> None:
    op, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, args=["--release", "/nonexistent/never"])
    op.execution_timeout = timedelta(seconds=4)
    with pytest.raises(SiteJobFailed, match="execution_timeout reached"):
        run_deferred(op, context_for(op))
    wait_for(lambda: pods(core, namespace) == [], 30, what="the timed-out pod is deleted")


def test_killing_a_deferred_task_deletes_its_pod_and_process(
    tmp_path, control_plane, node_agent, namespace, core
) -> None:
    op, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, args=["--release", "/nonexistent/never"])
    context = context_for(op)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    trigger = deferred.value.trigger
    name = op.pod.metadata.name
    wait_for(lambda: core.read_namespaced_pod(name, namespace).status.phase == "Running", 30, what="pod running")
    processes = set(node_agent.running_processes())
    assert processes, "the trainer runs as a process on the node"

    async def run_then_kill() -> None:
        task = asyncio.ensure_future(trigger.run().__anext__())
        await asyncio.sleep(1)
        assert not task.done()
        task.cancel()  # what the triggerer does on "mark failed" ...
        await trigger.on_kill()  # ... and then asks the trigger to clean up

    asyncio.run(run_then_kill())
    wait_for(lambda: pods(core, namespace) == [], 30, what="the killed task's pod is deleted")
    wait_for(lambda: not (set(node_agent.running_processes()) & processes), 30, what="the trainer process is gone")


def test_sync_mode_uses_the_same_state_table(tmp_path, control_plane, node_agent, namespace, core) -> None:
    op, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, image="registry.example/flare/invalid-image:1")
    op.deferrable = False
    with pytest.raises(SiteJobFailed, match="InvalidImageName"):
        op.execute(context_for(op))
    wait_for(lambda: pods(core, namespace) == [], 30, what="the failed pod is deleted")


def test_a_pod_site_without_a_way_to_the_local_store_is_a_parse_time_error(tmp_path) -> None:
    from flare_airflow.core.errors import ConfigError

    job = job_from_dict(
        {
            "job": "nostore",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(tiny_model(tmp_path / "init.safetensors")),
            "store": f"file://{tmp_path}/store",
            "trainer": {"script": str(TRAINER)},
            "sites": {"site-1": {"launcher": "k8s", "launcher_spec": {"k8s": {"image": "img:1"}}}},
        }
    )
    with pytest.raises(ConfigError, match=r"a local path the pod cannot see: set launcher_spec\.k8s\.store_mount"):
        SitePodOperator(task_id="site-1", job=job, site="site-1", round_num=1)


# ---------------------------------------------------------------- strict mode: the pod trains through its links


def links_op(tmp_path: pathlib.Path, namespace: str, kubeconfig: pathlib.Path, s3, *, mount=True, args=()):
    """Site-1 of a job whose store is the S3 emulator and which names no store connection: the
    central side minted round 1's links sealed to site-1's box key, in ``prepare``'s XCom."""
    store_uri = f"s3://{BUCKET}/pods-{tmp_path.name}"
    k8s_block = {
        "image": "registry.example/flare/trainer:1",
        "namespace": namespace,
        "config_file": str(kubeconfig),
        "trainer_command": [sys.executable],
        "trainer_script": str(TRAINER),
        "poll_interval": 1,
    }
    if mount:
        (tmp_path / "mount").mkdir()
        k8s_block["store_mount"] = {"host_path": str(tmp_path / "mount"), "mount_path": "/flare-store"}
    job = job_from_dict(
        {
            "job": "podjob",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(tiny_model(tmp_path / "init.safetensors")),
            "store": store_uri,
            "trainer": {"script": str(TRAINER), "args": list(args), "shutdown_timeout": 2},
            "sites": {"site-1": {"launcher": "k8s", "launcher_spec": {"k8s": k8s_block}}},
        }
    )
    assert job.store_conn_id is None
    store = ModelStore.from_uri(store_uri)
    model = FLModel(params={"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)})
    record = put_model(s3, store.global_model("podjob", RUN_ID, 0), model, tmp_path)
    sealed = mint_round_links(job, store, RUN_ID, 1, record.size, Log(), client=s3.client())
    assert sealed is not None and set(sealed) == {"site-1"}
    produced = {"sha256": record.sha256, "signed": sign_global("podjob", RUN_ID, 0, record), LINKS_KEY: sealed}

    def make() -> SitePodOperator:  # a task as a (new) worker process parses it
        return SitePodOperator(
            task_id="site-1", job=job, site="site-1", round_num=1, global_task_id="prepare", deferrable=True
        )

    return make, store, produced


def links_context(op: SitePodOperator, produced: dict[str, Any], pushed: dict[str, Any]) -> dict[str, Any]:
    context = context_for(op)
    ti = context["ti"]
    ti.xcom_pull = lambda task_ids=None, **_: produced if task_ids == "prepare" else None
    ti.xcom_push = lambda key, value: pushed.__setitem__(key, value)
    return context


def staged_files(tmp_path: pathlib.Path) -> list[str]:
    top = tmp_path / "mount" / LINKS_STAGING_DIR
    return sorted(str(p.relative_to(top)) for p in top.rglob("*")) if top.exists() else []


@pytest.mark.usefixtures("keys")
def test_a_pod_site_trains_through_its_links_across_a_resume(
    tmp_path, control_plane, node_agent, namespace, core, s3
) -> None:
    """No store connection anywhere: the worker stages round 1 through the links into the shared
    mount; the pod sees two files and its folder, no key and no link; a task resumed in a fresh
    operator (as a new process) finds the folder, accepts the update and uploads it; nothing stays."""
    make, store, produced = links_op(tmp_path, namespace, control_plane.kubeconfig, s3)
    op, pushed = make(), {}
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(links_context(op, produced, pushed))
    container = op.pod.spec.containers[0]
    values = [e.value or "" for e in container.env]
    assert not any("X-Amz" in v or "http" in v for v in values), "the pod holds no link"
    sub_paths = sorted(m.sub_path for m in container.volume_mounts if m.sub_path)
    assert sub_paths and all(p.startswith(f"{LINKS_STAGING_DIR}/podjob/") for p in sub_paths), sub_paths
    assert any(f.endswith("global/global.safetensors") for f in staged_files(tmp_path)), "staged in"

    async def first_event() -> dict[str, Any]:
        async for event in deferred.value.trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    event = asyncio.run(first_event())
    resumed = make()  # another process: it holds nothing of the first one's staging
    summary = getattr(resumed, deferred.value.method_name)(links_context(resumed, produced, pushed), event)
    slot = store.site_update("podjob", RUN_ID, 1, "site-1")
    assert summary["site"] == "site-1" and summary["uri"] == str(slot)
    assert pushed["return_value"]["uri"] == summary["uri"], "XCom names the store's slot, not the folder"
    record = json.loads(get(s3, record_path(slot)))
    assert record["sha256"] == summary["sha256"] and record["num_samples"] == 7, "the accepted update uploaded"
    np.testing.assert_array_equal(load(get(s3, slot))["w"], np.ones(4, np.float32))
    assert staged_files(tmp_path) == [], "nothing left in the staging folder"
    assert pods(core, namespace) == []


@pytest.mark.usefixtures("keys")
def test_a_failing_pod_uploads_its_failure_record_through_its_links(
    tmp_path, control_plane, node_agent, namespace, core, s3
) -> None:
    make, store, produced = links_op(tmp_path, namespace, control_plane.kubeconfig, s3, args=["--exit", "3"])
    op = make()
    op.deferrable = False  # the same trigger in the worker: execute ends the task
    with pytest.raises(SiteJobFailed, match="EXECUTION_ERROR"):
        op.execute(links_context(op, produced, {}))
    failure = json.loads(get(s3, failure_path(store.site_update("podjob", RUN_ID, 1, "site-1"))))
    assert failure["return_code"] == 1 and "exit code 3" in failure["reason"], failure
    assert staged_files(tmp_path) == []
    wait_for(lambda: pods(core, namespace) == [], 30, what="the failed pod is deleted")


@pytest.mark.usefixtures("keys")
def test_a_strict_pod_site_without_a_shared_store_mount_is_a_config_error(tmp_path, s3) -> None:
    make, store, produced = links_op(tmp_path, "unused", tmp_path / "no-kubeconfig", s3, mount=False)
    op = make()
    with pytest.raises(SiteJobFailed, match=r"set launcher_spec\.k8s\.store_mount.*\[CONFIG_ERROR\]"):
        op.execute(links_context(op, produced, {}))
    failure = json.loads(get(s3, failure_path(store.site_update("podjob", RUN_ID, 1, "site-1"))))
    assert "store_mount" in failure["reason"], failure
