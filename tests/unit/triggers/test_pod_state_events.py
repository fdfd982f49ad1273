"""When PodStateTrigger reads Warning events: only for a pod bound to a node and still Pending,
and then its watch stays short so that a FailedMount (an event, never a pod change) is seen in seconds."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import models as k8s

from flare_airflow.triggers.pod_state import _EVENT_CHECK_SECONDS, PodStateTrigger


def pod(phase: str, node: str | None = None) -> k8s.V1Pod:
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name="p", namespace="ns", uid="uid-1", creation_timestamp=datetime.now(UTC)
        ),  # now, not at import: the suite may run for minutes first
        spec=k8s.V1PodSpec(
            node_name=node,
            containers=[k8s.V1Container(name="trainer")],
            volumes=[k8s.V1Volume(name="flare-store", host_path=k8s.V1HostPathVolumeSource(path="/x"))],
        ),
        status=k8s.V1PodStatus(phase=phase),
    )


class FakeCore:
    """Answers list_namespaced_event with ``events`` and records the field selectors asked for."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events
        self.selectors: list[str] = []

    async def list_namespaced_event(self, namespace: str, *, field_selector: str, **_: Any) -> Any:
        self.selectors.append(field_selector)
        return k8s.CoreV1EventList(items=self.events)


def mount_event() -> k8s.CoreV1Event:
    return k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(name="e"),
        involved_object=k8s.V1ObjectReference(name="p", uid="uid-1"),
        reason="FailedMount",
        message='MountVolume.SetUp failed for volume "flare-store" : hostPath type check failed',
        type="Warning",
    )


def trigger() -> PodStateTrigger:
    return PodStateTrigger(pod_name="p", pod_namespace="ns", pending_timeout=300, startup_timeout=120)


def test_a_bound_pending_pod_fails_on_its_failed_mount_event() -> None:
    core = FakeCore([mount_event()])
    status = asyncio.run(trigger()._decide(core, pod("Pending", node="node-1")))
    assert status.done and status.reason.startswith("FailedMount: MountVolume.SetUp failed")
    assert core.selectors == ["involvedObject.name=p,type=Warning"]


def test_events_are_not_read_for_unbound_or_running_pods() -> None:
    core = FakeCore([mount_event()])
    for p in (pod("Pending"), pod("Running", node="node-1")):
        assert not asyncio.run(trigger()._decide(core, p)).done
    assert core.selectors == []


def test_the_watch_of_a_bound_pending_pod_is_short_and_of_a_running_pod_long() -> None:
    t = trigger()
    assert t._watch_seconds(pod("Pending", node="node-1")) == _EVENT_CHECK_SECONDS
    assert t._watch_seconds(pod("Pending")) == 60  # half the shorter timeout: only deadlines to check
    assert t._watch_seconds(pod("Running", node="node-1")) == 1800
