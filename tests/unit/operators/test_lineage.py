"""OpenLineage datasets of the aggregation and publish tasks, named by OpenLineage's conventions."""

from __future__ import annotations

import pytest
from airflow.providers.openlineage.extractors import OperatorLineage

from flare_airflow.operators.lineage import LineageMixin, dataset_name


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (
            "file:///srv/store/demo/run/round_1/global.safetensors",
            ("file", "/srv/store/demo/run/round_1/global.safetensors"),
        ),
        ("/srv/store/m.safetensors", ("file", "/srv/store/m.safetensors")),
        ("s3://models/flare/demo/round_1/global.safetensors", ("s3://models", "flare/demo/round_1/global.safetensors")),
    ],
)
def test_dataset_names(uri: str, expected: tuple[str, str]) -> None:
    assert dataset_name(uri) == expected


def test_facets_name_what_execute_read_and_wrote() -> None:
    task = LineageMixin()
    assert task.get_openlineage_facets_on_complete(None) == OperatorLineage()  # before execute: nothing claimed
    task.lineage_io = (["s3://models/u/site-1.safetensors"], ["s3://models/g/global.safetensors"])
    lineage = task.get_openlineage_facets_on_complete(None)
    assert [(d.namespace, d.name) for d in lineage.inputs] == [("s3://models", "u/site-1.safetensors")]
    assert [(d.namespace, d.name) for d in lineage.outputs] == [("s3://models", "g/global.safetensors")]
