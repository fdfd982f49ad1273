"""A Kubernetes site job's identity: its pod's name, labels and label selectors.

The name is RFC 1123, at most 63 characters, readable (``fl-<job>-<site>-r<round>-<hash>``) and
unique per (run, round, site, try); the labels name job, run, round, site and try, so that every
try's pods of a site job (or of a whole run) can be found again. A multi-node site job (``nodes:
N``) is a group: a headless Service named :func:`group_name` and pods ``<group>-n<rank>``, all
with the site job's identity labels, the pods also with ``flare-airflow/node-rank``.
"""

from __future__ import annotations

import hashlib
import json
import re

from flare_airflow.core.config import MANAGED_BY_LABEL, RESERVED_LABEL_PREFIX
from flare_airflow.core.spec import JobIdentity

CONTAINER_NAME = "trainer"
RUN_ID_ANNOTATION = f"{RESERVED_LABEL_PREFIX}run-id"
TRY_LABEL = f"{RESERVED_LABEL_PREFIX}try"
NODE_RANK_LABEL = f"{RESERVED_LABEL_PREFIX}node-rank"

_MAX_NAME = 63
_NAME_PREFIX = "fl"
_HASHED = re.compile(r"-[0-9a-f]{8}\Z")


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:8]


def _dns_part(value: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")


def _name(job: str, site: str, round_num: int, run_id: str, try_number: int, reserve: int) -> str:
    if round_num < 0 or try_number < 0:
        raise ValueError(f"round ({round_num}) and try ({try_number}) must be >= 0")
    tail = f"-r{round_num}-{_digest(job, run_id, round_num, site, try_number)}"
    room = _MAX_NAME - reserve - len(_NAME_PREFIX) - len(tail) - 2  # the two '-' around job and site
    job_part, site_part = _dns_part(job), _dns_part(site)
    if len(job_part) + len(site_part) > room:
        # The site says more about a pod than the job (one DAG per job); it keeps at least half.
        site_len = min(len(site_part), max(room // 2, room - len(job_part)))
        job_part = job_part[: room - site_len].strip("-")
        site_part = site_part[:site_len].strip("-")
    return "-".join(p for p in (_NAME_PREFIX, job_part, site_part) if p) + tail


def pod_name(job: str, site: str, round_num: int, run_id: str, try_number: int) -> str:
    """``fl-<job>-<site>-r<round>-<8 hex>``: RFC 1123, at most 63 characters, stable.

    The hash covers (job, run, round, site, try), so names differ per run and per try while the
    readable part says what the pod is; job and site are shortened when the name would be too long.
    """
    return _name(job, site, round_num, run_id, try_number, 0)


def group_name(job: str, site: str, round_num: int, run_id: str, try_number: int, nodes: int) -> str:
    """The name of a multi-node site job's headless Service: like :func:`pod_name`, shortened so that
    ``<group>-n<node rank>`` (:func:`node_pod_name`) still fits 63 characters. Also an RFC 1035
    label (it starts with a letter), as a Service name must be."""
    return _name(job, site, round_num, run_id, try_number, len(_node_suffix(nodes - 1)))


def _node_suffix(node_rank: int) -> str:
    return f"-n{node_rank}"


def node_pod_name(group: str, node_rank: int) -> str:
    """The pod of node ``node_rank`` of the group :func:`group_name` named; also its hostname."""
    return group + _node_suffix(node_rank)


def _label_value(value: str) -> str:
    """``value`` if it is a label value that cannot be mistaken for a shortened one, else a safe form + hash."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", value).strip("._-")
    if cleaned == value and len(value) <= _MAX_NAME and not _HASHED.search(value):
        return value
    short = cleaned[: _MAX_NAME - 9].rstrip("._-")
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    return f"{short}-{digest}" if short else digest


def pod_labels(job: str, run_id: str, round_num: int, site: str, try_number: int) -> dict[str, str]:
    """The labels that identify a site job's pod (select with ``flare-airflow/run=<pod_labels(...)[...]>``)."""
    return {
        MANAGED_BY_LABEL: "flare-airflow",
        f"{RESERVED_LABEL_PREFIX}job": _label_value(job),
        f"{RESERVED_LABEL_PREFIX}run": _label_value(run_id),
        f"{RESERVED_LABEL_PREFIX}round": str(round_num),
        f"{RESERVED_LABEL_PREFIX}site": _label_value(site),
        TRY_LABEL: str(try_number),
    }


def node_labels(identity: dict[str, str], node_rank: int) -> dict[str, str]:
    """A multi-node site job's pod labels: the site job's identity (:func:`pod_labels`) and its node rank."""
    return {**identity, NODE_RANK_LABEL: str(node_rank)}


def site_pods_selector(job: str, run_id: str, round_num: int | None = None, site: str | None = None) -> str:
    """Label selector for the pods of a run, or of one site job (round and site) of it, every try."""
    labels = pod_labels(job, run_id, round_num or 0, site or "", 0)
    keys = [MANAGED_BY_LABEL, f"{RESERVED_LABEL_PREFIX}job", f"{RESERVED_LABEL_PREFIX}run"]
    if round_num is not None:
        keys.append(f"{RESERVED_LABEL_PREFIX}round")
    if site is not None:
        keys.append(f"{RESERVED_LABEL_PREFIX}site")
    return ",".join(f"{key}={labels[key]}" for key in keys)


def site_job_selector(identity: JobIdentity) -> str:
    """Label selector for the pods of one launch of a site job: its (job, run, round, site) and try.

    It selects every pod of that launch (one, or several for a multi-pod site job), whatever their
    names: how a launch is found again (:meth:`KubernetesLauncher.find_job`).
    """
    selector = site_pods_selector(identity.job, identity.run_id, identity.round, identity.site)
    return f"{selector},{TRY_LABEL}={identity.try_number}"
