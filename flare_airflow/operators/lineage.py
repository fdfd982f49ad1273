"""OpenLineage for the run's own tasks: what a round's aggregation read and wrote, what publish published.

Airflow's OpenLineage provider, when it is installed and configured, asks a finished task for
``get_openlineage_facets_on_complete``; without the provider nothing calls it and nothing of
OpenLineage is imported. Datasets are named by OpenLineage's conventions for files and object
stores: ``file`` + absolute path, ``s3://bucket`` + key (``gs``, ``abfss`` alike).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit


def dataset_name(uri: str) -> tuple[str, str]:
    """(namespace, name) of a model store path or URI."""
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):
        return "file", parts.path if parts.scheme else uri
    return f"{parts.scheme}://{parts.netloc}", parts.path.lstrip("/")


class LineageMixin:
    """``get_openlineage_facets_on_complete`` for an operator whose ``execute`` set ``lineage_io``."""

    # (URIs read, URIs written) by the last execute; None before it ran.
    lineage_io: tuple[list[str], list[str]] | None = None

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        from airflow.providers.openlineage.extractors import OperatorLineage
        from openlineage.client.event_v2 import Dataset

        inputs, outputs = self.lineage_io or ([], [])

        def datasets(uris: Iterable[str]) -> list[Any]:
            return [Dataset(namespace=ns, name=name) for ns, name in map(dataset_name, uris)]

        return OperatorLineage(inputs=datasets(inputs), outputs=datasets(outputs))
