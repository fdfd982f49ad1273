"""SitePodOperator when things break, on the real control plane (the LOCAL NODE AGENT test harness
plays the kubelet): a trigger that fails mid-watch leaves no pod behind, and a volume that cannot be
mounted (``FailedMount``, seen only as a Warning event) fails the site task within seconds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred
from kubernetes import client as k8s

from flare_airflow.operators.site_steps import SiteJobFailed
from flare_airflow.triggers.pod_state import PodStateTrigger
from flare_airflow_testing.k8s.audit import summarize
from flare_airflow_testing.k8s.kube import wait_for
from tests.integration.k8s.test_site_pod_operator import context_for, make_op, pods

INJECTED = "injected: the watch broke"


@pytest.fixture
def watch_breaks_once_the_pod_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every trigger run raises inside its watch as soon as it sees the pod Running."""
    seen: list[str] = []
    decide = PodStateTrigger._decide

    async def broken(self: PodStateTrigger, core: Any, pod: Any) -> Any:
        status = await decide(self, core, pod)
        if pod is not None and pod.status is not None and pod.status.phase == "Running":
            seen.append(pod.metadata.name)
            raise RuntimeError(INJECTED)
        return status

    monkeypatch.setattr(PodStateTrigger, "_decide", broken)
    return seen


def test_a_trigger_that_fails_mid_watch_leaves_no_pod(
    tmp_path, control_plane, node_agent, namespace, core, watch_breaks_once_the_pod_runs
) -> None:
    op, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, args=["--release", "/nonexistent/never"])
    context = context_for(op)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    name = op.pod.metadata.name
    events: list[dict[str, Any]] = []

    async def first_event(trigger: PodStateTrigger) -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    # Airflow's loop: run the trigger, re-enter; the operator re-defers while the pod runs.
    with pytest.raises(SiteJobFailed, match=INJECTED) as failed:
        for _ in range(op.MAX_REDEFER_ATTEMPTS + 2):
            event = asyncio.run(first_event(deferred.value.trigger))
            events.append(event)
            assert event["status"] == "error" and INJECTED in event["reason"]
            try:
                getattr(op, deferred.value.method_name)(context, event)
            except TaskDeferred as again:
                assert pods(core, namespace) == [name], "a re-deferred pod keeps running"
                deferred = pytest.ExceptionInfo.from_exc_info((TaskDeferred, again, again.__traceback__))
    assert [e["_redefer_count"] for e in events] == list(range(op.MAX_REDEFER_ATTEMPTS + 1))
    assert "[INFRASTRUCTURE_ERROR]" in str(failed.value)
    assert watch_breaks_once_the_pod_runs == [name] * len(events), "each failure was mid-watch"
    wait_for(lambda: pods(core, namespace) == [], 30, what="the pod is deleted")


def test_sync_mode_deletes_the_pod_when_its_watch_fails(
    tmp_path, control_plane, node_agent, namespace, core, watch_breaks_once_the_pod_runs
) -> None:
    op, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, args=["--release", "/nonexistent/never"])
    op.deferrable = False
    processes: set[int] = set()
    with pytest.raises(SiteJobFailed, match=INJECTED):
        op.execute(context_for(op))
    assert watch_breaks_once_the_pod_runs, "the watch failed mid-watch"
    processes = set(node_agent.running_processes())
    wait_for(lambda: pods(core, namespace) == [], 30, what="the pod is deleted")
    wait_for(lambda: not (set(node_agent.running_processes()) & processes), 30, what="no trainer left")


def test_failed_mount_fails_the_site_task_within_seconds_with_the_reason(
    tmp_path, control_plane, node_agent, namespace, core: k8s.CoreV1Api, audit, monkeypatch
) -> None:
    # The store's node path does not exist (a node without the site's share): the node agent, as a
    # kubelet, keeps the pod ContainerCreating and reports only a FailedMount Warning event.
    missing = {"host_path": str(tmp_path / "no-such-share"), "mount_path": "/flare-store"}
    op, _ = make_op(tmp_path, namespace, control_plane.kubeconfig, store_mount=missing)
    reads: list[float] = []
    warnings = PodStateTrigger._warnings

    async def counted(self: PodStateTrigger, core: Any, pod: Any) -> list[Any]:
        reads.append(time.monotonic())
        return await warnings(self, core, pod)

    monkeypatch.setattr(PodStateTrigger, "_warnings", counted)
    mark = audit.mark()
    started = time.monotonic()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context_for(op))

    async def first_event() -> dict[str, Any]:
        async for event in deferred.value.trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    event = asyncio.run(first_event())
    elapsed = time.monotonic() - started
    assert event["status"] == "timeout" and event["reason"].startswith("FailedMount: "), event
    assert '"flare-store"' in event["reason"]
    with pytest.raises(SiteJobFailed, match=r"FailedMount: .*\[INFRASTRUCTURE_ERROR\]"):
        getattr(op, deferred.value.method_name)(context_for(op), event)
    assert elapsed < 15, f"FailedMount took {elapsed:.1f} s (startup_timeout is 120 s)"
    wait_for(lambda: pods(core, namespace) == [], 30, what="the pod is deleted")
    audit.settle()
    counts = summarize(audit.client_requests(namespace, since=mark))
    print(f"\nFailedMount in {elapsed:.1f} s; trigger event reads: {len(reads)}; API requests: {counts}")
    # Events are read only while the bound pod is Pending: per pod update and per 5-s watch window.
    assert 1 <= len(reads) <= 2 + 2 * int(elapsed / 5), reads
