"""Talking to the Kubernetes API -- the one home of site-pod I/O, in sync and async forms.

The sync forms (``kubernetes``: the launcher's handle, the pod task, the run's sweep) and the async
forms (``kubernetes_asyncio``: the pod-state trigger in the triggerer) share their rules, as the
cncf provider's ``PodManager`` / ``AsyncPodManager`` share ``await_pod_start``: which pods need
their Warning events read while they start (:func:`needs_warning_events`) and how they are asked
for (:func:`warning_events_selector`), and what deleting a pod means (a pod already gone is done;
another pod under the same name is not ours: :func:`delete_options`, :data:`GONE`). Timeouts and
retries with backoff for the sync calls; the trigger counts its own failures.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity
import urllib3
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from flare_airflow.launchers.kubernetes.naming import TRY_LABEL
from flare_airflow.launchers.kubernetes.state import FAIL_FAST_REASONS, container_statuses

_T = TypeVar("_T")
REQUEST_TIMEOUT = 30
_FINISHED_PHASES = ("Succeeded", "Failed")
# Statuses of a delete that mean done: the pod is gone already (404), or another pod now has its
# name (409, the uid precondition failed: ours is gone too).
GONE = (404, 409)


# ---------------------------------------------------------------------- the shared rules


def needs_warning_events(pod: Any) -> bool:
    """Whether the pod's Warning events can change its state: bound to a node but still Pending
    (a volume that cannot be mounted shows only as an event, never as a pod change) and not
    already failing for a reason the state table fails fast on."""
    spec, status = getattr(pod, "spec", None), getattr(pod, "status", None)
    if pod is None or not getattr(spec, "node_name", None) or getattr(status, "phase", None) not in (None, "Pending"):
        return False
    return not any(
        s.state and s.state.waiting and s.state.waiting.reason in FAIL_FAST_REASONS for s in container_statuses(status)
    )


def warning_events_selector(pod: Any) -> str:
    """The field selector of ``pod``'s Warning events, by name (the state table tells the events
    of an earlier pod of the same name apart by uid)."""
    return f"involvedObject.name={pod.metadata.name},type=Warning"


def delete_options(grace: int | None, uid: str | None = None) -> k8s.V1DeleteOptions:
    """How a site pod is deleted: ``grace`` seconds to stop (``None``: the pod's own), and only the
    pod with ``uid`` when given (never another pod that took its name)."""
    return k8s.V1DeleteOptions(grace_period_seconds=grace, preconditions=k8s.V1Preconditions(uid=uid))


# ---------------------------------------------------------------------- sync forms


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in (0, 429) or (exc.status or 0) >= 500
    return isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


def retrying(call: Callable[[], _T]) -> _T:
    """Run an idempotent API call, retrying transient failures (5xx, 429, connection errors) with backoff."""
    retryer = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_transient),
        stop=tenacity.stop_after_attempt(6) | tenacity.stop_after_delay(60),
        wait=tenacity.wait_exponential(multiplier=0.25, max=8),
        reraise=True,
    )
    return retryer(call)


def api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message") or exc.reason)
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or exc.reason)


def list_site_pods(core: k8s.CoreV1Api, namespace: str, selector: str) -> list[Any]:
    """The pods ``selector`` finds in ``namespace`` (reads retried on transient errors): the one
    lookup of site pods by identity, for finding a launch again, earlier tries and a run's sweep."""

    def listed() -> list[Any]:
        return list(
            core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT).items
        )

    return retrying(listed)


def list_site_services(core: k8s.CoreV1Api, namespace: str, selector: str) -> list[Any]:
    """The Services ``selector`` finds in ``namespace``: the headless Services of multi-node site jobs."""

    def listed() -> list[Any]:
        return list(
            core.list_namespaced_service(namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT).items
        )

    return retrying(listed)


def delete_site_pods(
    core: k8s.CoreV1Api,
    namespace: str,
    selector: str,
    *,
    before_try: int | None = None,
    keep_finished: bool = False,
) -> list[str]:
    """Delete, with no grace period, the pods ``selector`` finds in ``namespace``, and the Services of
    multi-node site jobs it finds; return their names.

    ``before_try``: only pods of tries below it (a new try supersedes them: they run unwatched,
    their task process is gone). ``keep_finished``: leave pods that already finished (a site that
    keeps pods for debugging); running and pending ones are deleted all the same. API reads and
    deletes are retried on transient errors; a pod that is already gone is not an error.
    """
    deleted = []
    for pod in list_site_pods(core, namespace, selector):
        try_label = (pod.metadata.labels or {}).get(TRY_LABEL, "")
        if before_try is not None and not (try_label.isdigit() and int(try_label) < before_try):
            continue
        phase = pod.status.phase if pod.status is not None else None
        if keep_finished and phase in _FINISHED_PHASES:
            continue

        delete_pod(core, namespace, pod.metadata.name, grace=0, uid=pod.metadata.uid)
        deleted.append(f"{pod.metadata.name} (try {try_label or '?'}, {phase or 'unknown phase'})")

    # A multi-node site job's headless Service goes with its pods (kept pods need no rendezvous).
    for service in list_site_services(core, namespace, selector):
        try_label = (service.metadata.labels or {}).get(TRY_LABEL, "")
        if before_try is not None and not (try_label.isdigit() and int(try_label) < before_try):
            continue
        delete_service(core, namespace, service.metadata.name, service.metadata.uid)
        deleted.append(f"service {service.metadata.name} (try {try_label or '?'})")
    return deleted


def delete_pod(core: k8s.CoreV1Api, namespace: str, name: str, *, grace: int | None, uid: str | None = None) -> None:
    """Delete one pod (:func:`delete_options`), retried on transient errors; a pod gone is done."""

    def delete() -> None:
        try:
            core.delete_namespaced_pod(
                name, namespace, body=delete_options(grace, uid), _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status not in GONE:
                raise

    retrying(delete)


def list_warning_events(core: k8s.CoreV1Api, namespace: str, pod: Any) -> list[Any]:
    """``pod``'s Warning events while they can matter (:func:`needs_warning_events`), else none."""
    if not needs_warning_events(pod):
        return []

    def read() -> list[Any]:
        listed = core.list_namespaced_event(
            namespace, field_selector=warning_events_selector(pod), _request_timeout=REQUEST_TIMEOUT
        )
        return list(listed.items)

    return retrying(read)


def delete_service(core: k8s.CoreV1Api, namespace: str, name: str, uid: str | None) -> None:
    """Delete a Service (only the one with ``uid`` when given); a Service already gone is not an error."""

    def delete() -> None:
        try:
            core.delete_namespaced_service(
                name,
                namespace,
                body=k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=uid)),
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    retrying(delete)


# ---------------------------------------------------------------------- async forms (the triggerer)


async def delete_pod_async(core: Any, namespace: str, name: str, *, grace: int | None) -> None:
    """:func:`delete_pod` with a ``kubernetes_asyncio`` client; a pod gone is done."""
    from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

    try:
        await core.delete_namespaced_pod(name, namespace, grace_period_seconds=grace)
    except AsyncApiException as exc:
        if exc.status not in GONE:
            raise


async def delete_group_async(core: Any, namespace: str, selector: str, *, grace: int | None) -> None:
    """Every pod and the headless Service of a multi-node site job (``selector``: its identity)."""
    from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

    await core.delete_collection_namespaced_pod(namespace, label_selector=selector, grace_period_seconds=grace)
    services = await core.list_namespaced_service(namespace, label_selector=selector)
    for service in services.items:
        try:
            await core.delete_namespaced_service(service.metadata.name, namespace)
        except AsyncApiException as exc:
            if exc.status not in GONE:
                raise


async def list_warning_events_async(core: Any, namespace: str, pod: Any, *, request_timeout: float) -> list[Any]:
    """:func:`list_warning_events` with a ``kubernetes_asyncio`` client (the caller decides what a
    refused read means: a site's role may not read events)."""
    if not needs_warning_events(pod):
        return []
    listed = await core.list_namespaced_event(
        namespace, field_selector=warning_events_selector(pod), _request_timeout=request_timeout
    )
    return list(listed.items)
