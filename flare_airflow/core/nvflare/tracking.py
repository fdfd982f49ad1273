"""NVFlare's ``nvflare.client.tracking`` writers: their scalars land in the round's metrics.

NVFlare streams tracking records to the server's TensorBoard/MLflow receiver. Here a site job is
one round, and what leaves a site is its update: each scalar becomes a metric of the update (the
last value logged under a tag wins), which the aggregation writes to the run's ``metrics.json``.
Images, text, tags and parameters have no place in a round's metrics and are not kept.
"""

from __future__ import annotations

from typing import Any

from flare_airflow.core.nvflare.client import log
from flare_airflow.core.nvflare.fl_model import AnalyticsDataType

__all__ = ["MLflowWriter", "SummaryWriter"]


class SummaryWriter:
    """TensorBoard's writer as NVFlare's Client API offers it."""

    def add_scalar(self, tag: str, scalar: float, global_step: int | None = None, **kwargs: Any) -> None:
        log(tag, scalar, AnalyticsDataType.SCALAR, global_step=global_step, **kwargs)

    def add_scalars(self, tag: str, scalars: dict[str, float], global_step: int | None = None, **kwargs: Any) -> None:
        log(tag, scalars, AnalyticsDataType.SCALARS, global_step=global_step, **kwargs)

    def flush(self) -> None:
        """Scalars are sent with the update: nothing to flush."""


class MLflowWriter:
    """MLflow's calls as NVFlare's Client API offers them: metrics are kept, the rest is not."""

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        log(key, value, AnalyticsDataType.METRIC, global_step=step)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        log("metrics", metrics, AnalyticsDataType.METRICS, global_step=step)

    def log_param(self, key: str, value: Any) -> None:
        """Parameters are not round metrics: not kept."""

    def log_params(self, values: dict[str, Any]) -> None:
        """Parameters are not round metrics: not kept."""

    def set_tag(self, key: str, tag: Any) -> None:
        """Tags are not round metrics: not kept."""

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Tags are not round metrics: not kept."""

    def log_text(self, text: str, artifact_file_path: str) -> None:
        """Text is not a round metric: not kept."""
