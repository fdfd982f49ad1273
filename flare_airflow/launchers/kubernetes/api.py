"""Talking to the Kubernetes API: timeouts, retries with backoff, and finding / deleting site pods
(and the headless Services of multi-node site jobs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity
import urllib3
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from flare_airflow.launchers.kubernetes.naming import TRY_LABEL

_T = TypeVar("_T")
REQUEST_TIMEOUT = 30
_FINISHED_PHASES = ("Succeeded", "Failed")


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

        def delete(name: str = pod.metadata.name, uid: str | None = pod.metadata.uid) -> None:
            try:
                core.delete_namespaced_pod(
                    name,
                    namespace,
                    body=k8s.V1DeleteOptions(grace_period_seconds=0, preconditions=k8s.V1Preconditions(uid=uid)),
                    _request_timeout=REQUEST_TIMEOUT,
                )
            except ApiException as exc:
                if exc.status not in (404, 409):  # gone already / another pod under that name now
                    raise

        retrying(delete)
        deleted.append(f"{pod.metadata.name} (try {try_label or '?'}, {phase or 'unknown phase'})")

    # A multi-node site job's headless Service goes with its pods (kept pods need no rendezvous).
    for service in list_site_services(core, namespace, selector):
        try_label = (service.metadata.labels or {}).get(TRY_LABEL, "")
        if before_try is not None and not (try_label.isdigit() and int(try_label) < before_try):
            continue
        delete_service(core, namespace, service.metadata.name, service.metadata.uid)
        deleted.append(f"service {service.metadata.name} (try {try_label or '?'})")
    return deleted


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
