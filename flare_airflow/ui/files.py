"""The run's published outputs in the model store, as the Federated runs page offers them: found
from the publish task's XCom only where publish writes, described with their sha256, streamed."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from airflow.configuration import conf
from fastapi import HTTPException

from flare_airflow.core.errors import FlareAirflowError, ReportError
from flare_airflow.core.model import read_record
from flare_airflow.core.page_paths import file_path
from flare_airflow.core.report import read_metrics
from flare_airflow.core.store import ModelStore, run_component
from flare_airflow.operators.common import default_store_uri

CHUNK = 1 << 20


class PublishedFile(NamedTuple):
    xcom_key: str  # the publish task's XCom names its path under this key
    label: str
    media_type: str
    file_name: str  # its name under ``<store>/<job>/<run>/final/``


FILES = {
    "model": PublishedFile("final_model", "final model (safetensors)", "application/octet-stream", "model.safetensors"),
    "metrics": PublishedFile("metrics", "metrics.json", "application/json", "metrics.json"),
    "plot": PublishedFile("plot", "metrics.png", "image/png", "metrics.png"),
}


def store_roots() -> list[ModelStore]:
    """The stores the page may read from: ``[flare_airflow] store_roots`` (comma-separated URIs),
    else the default store under AIRFLOW_HOME. A URI from an XCom outside them is refused."""
    configured = conf.get("flare_airflow", "store_roots", fallback="") or ""
    uris = [u.strip() for u in configured.split(",") if u.strip()] or [default_store_uri()]
    return [ModelStore.from_uri(u) for u in uris]


def _final_path(uri: Any, run_id: str, name: str) -> Any:
    """The path of a published output named in the publish task's XCom, if it is where publish
    writes (``<store>/<job>/<run>/final/<name>`` in a configured store); else None."""
    if not isinstance(uri, str):
        return None
    for store in store_roots():
        try:
            path = store.resolve_uri(uri)
        except FlareAirflowError:
            continue
        if path.name == name and path.parent.name == "final" and path.parent.parent.name == run_component(run_id):
            return path
    return None


def chunks(path: Any) -> Iterator[bytes]:
    with path.open("rb") as fh:
        while piece := fh.read(CHUNK):
            yield piece


def _sha256_of(path: Any) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    for piece in chunks(path):
        digest.update(piece)
        size += len(piece)
    return digest.hexdigest(), size


def published_outputs(run_id: str, published: Any) -> dict[str, Any]:
    """name -> path of the run's published outputs that exist in a configured store."""
    if not isinstance(published, Mapping):
        return {}
    found = {}
    for name, file in FILES.items():
        path = _final_path(published.get(file.xcom_key), run_id, file.file_name)
        if path is not None and path.exists():
            found[name] = path
    return found


def describe_downloads(base: str, dag_id: str, run_id: str, outputs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Download links with sha256: the model's from its record (what the store vouches for), the
    others hashed now."""
    out = []
    for name, path in outputs.items():
        if name == "model":
            try:
                record = read_record(path)
            except FlareAirflowError as exc:
                raise HTTPException(500, f"the final model's record is unusable: {exc}") from None
            sha, size, source = record.sha256, path.stat().st_size, "record (model.json)"
        else:
            (sha, size), source = _sha256_of(path), "computed now"
        out.append(
            {
                "name": name,
                "label": FILES[name].label,
                "href": file_path(dag_id, run_id, name, base),
                "sha256": sha,
                "sha256_from": source,
                "size": size,
            }
        )
    return out


def metrics_of(path: Any) -> dict[str, Any]:
    try:
        return {"rounds": read_metrics(path)}
    except ReportError as exc:
        raise HTTPException(500, str(exc)) from None
