"""Small helpers for tests against the harness control plane (waiting, reading logs, local volumes)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.1, what: str = "condition") -> T:
    """Poll until ``predicate()`` is truthy and return it; ``TimeoutError`` naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def pod_dict(core: k8s.CoreV1Api, ns: str, name: str) -> dict[str, Any] | None:
    """The pod as plain JSON (None when it does not exist)."""
    try:
        return json.loads(core.read_namespaced_pod(name, ns, _preload_content=False).data)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def wait_for_phase(
    core: k8s.CoreV1Api, ns: str, name: str, phases: tuple[str, ...] = ("Succeeded", "Failed"), timeout: float = 60
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        pod = pod_dict(core, ns, name)
        return pod if pod and (pod.get("status") or {}).get("phase") in phases else None

    return wait_for(check, timeout, what=f"pod {ns}/{name} in {phases}")


def container_state(pod: dict[str, Any], index: int = 0) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return statuses[index]["state"] if len(statuses) > index else {}


def wait_for_waiting_reason(
    core: k8s.CoreV1Api, ns: str, name: str, reasons: tuple[str, ...], timeout: float = 30
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        pod = pod_dict(core, ns, name)
        reason = ((container_state(pod) if pod else {}).get("waiting") or {}).get("reason")
        return pod if reason in reasons else None

    return wait_for(check, timeout, what=f"pod {ns}/{name} waiting with {reasons}")


def delete_and_wait(core: k8s.CoreV1Api, ns: str, name: str, grace: int | None = None, timeout: float = 60) -> float:
    """Delete a pod (graceful unless ``grace=0``) and wait until it is gone; returns the seconds it took."""
    t0 = time.monotonic()
    try:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=grace)
    except ApiException as e:
        if e.status != 404:
            raise
    wait_for(lambda: pod_dict(core, ns, name) is None, timeout, what=f"pod {ns}/{name} to disappear")
    return time.monotonic() - t0


def read_log(core: k8s.CoreV1Api, ns: str, name: str, **kwargs: Any) -> str:
    """Pod log as text. ``kubernetes`` 36 returns ``str(bytes)`` from ``read_namespaced_pod_log``
    (kubernetes-client/python#2596), so read the raw response."""
    resp = core.read_namespaced_pod_log(name, ns, _preload_content=False, **kwargs)
    return resp.data.decode()


def python_pod(name: str, code: str, python: str, **container: Any) -> dict[str, Any]:
    """A restartPolicy=Never pod whose one container runs ``python -c code``."""
    spec_extra = container.pop("pod_spec", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "flare-harness-test"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "python:3.11-slim", "command": [python, "-c", code], **container}],
            **spec_extra,
        },
    }


def create_local_volume(
    core: k8s.CoreV1Api, ns: str, claim: str, path: str, size: str = "1Gi", timeout: float = 30
) -> str:
    """A hostPath PersistentVolume pre-bound to a new PVC ``claim`` in ``ns``; waits until Bound.

    The real scheduler refuses pods whose PVC does not exist or is unbound, so PVC-backed pods need
    both objects; the node agent then maps the claim to ``path``. Returns the PV name (delete it
    after the test; PVs are cluster-scoped).
    """
    pv_name = f"{ns}-{claim}"[:63]
    core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": path, "type": "DirectoryOrCreate"},
                "claimRef": {"namespace": ns, "name": claim},
            },
        }
    )
    core.create_namespaced_persistent_volume_claim(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": size}},
            },
        },
    )

    def bound() -> bool:
        pvc = core.read_namespaced_persistent_volume_claim(claim, ns)
        return pvc.status.phase == "Bound"

    wait_for(bound, timeout, what=f"PVC {ns}/{claim} to be Bound")
    return pv_name
