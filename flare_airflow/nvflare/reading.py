"""What reading an NVFlare job finds: refusals and notes, each with its file and line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from flare_airflow.nvflare.configs import Component, Where

# Components whose job flare-airflow does another way: carried over as a note each.
NOTED = {
    "IntimeModelSelector": "flare-airflow publishes the last round's global model, not the best one by a metric",
    "MetricsArtifactWriter": "the rounds' metrics are written to the run's metrics.json",
    "TBAnalyticsReceiver": "tracking scalars land in the round's metrics (metrics.json), not TensorBoard",
    "MLflowReceiver": "tracking scalars land in the round's metrics (metrics.json); publish them with MLflow there",
    "WandBReceiver": "tracking scalars land in the round's metrics (metrics.json)",
    "ValidationJsonGenerator": "cross-site validation results are not produced",
    "PTFileModelLocator": "cross-site evaluation's model locator is not needed",
    "NPModelLocator": "cross-site evaluation's model locator is not needed",
    "NPFormatter": "cross-site evaluation's formatter is not needed",
    "CellPipe": "NVFlare's pipe between its client and the script: the Client API reads the FLARE_* variables instead",
    "FilePipe": "NVFlare's pipe between its client and the script: the Client API reads the FLARE_* variables instead",
    "MetricRelayer": "tracking scalars travel with the update (its metrics)",
    "ExternalConfigurator": "the Client API's configuration comes from the site job's environment",
    "ConvertToFedEvent": "tracking events are not relayed to the server; scalars land in the round's metrics",
}


@dataclass
class Reading:
    """What the importer found, and what it refuses, before anything is written."""

    refused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def refuse(self, where: Where | Path, what: str, why: str, todo: str) -> None:
        self.refused.append(f"{where}: {what}: {why}; {todo}")

    def note(self, where: Where | Path, what: str, how: str) -> None:
        self.notes.append(f"{where}: {what}: {how}")


def known_or_refused(component: Component, reading: Reading) -> None:
    hint = NOTED.get(component.class_name)
    if hint:
        reading.note(component.where, component.path, hint)
    else:
        reading.refuse(
            component.where,
            f"component {component.id!r} ({component.path})",
            "flare-airflow has no equivalent",
            "remove it from the job, or do its work in the client script",
        )


def whole(value: Any) -> TypeGuard[int]:
    """An integer, and not a bool (``true`` is no round count, though Python's bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)
