"""Aggregation strategies. FedAvg: streaming, float64 accumulation, every update validated first.

Only one update is held in memory at a time: the accumulator has the size of the global model (in
float64) whatever the number of sites.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from flare_airflow.core.errors import FlareAirflowError, QuorumNotReached, UpdateRejected
from flare_airflow.core.model import (
    ArtifactRecord,
    Params,
    ParamsType,
    WritablePath,
    all_finite,
    read_artifact,
    tensor_spec,
)


def validate_update(site: str, expected: Mapping[str, tuple[str, tuple[int, ...]]], params: Params) -> None:
    """Raise ``UpdateRejected`` unless ``params`` matches the global model's names, shapes, dtypes.

    ``expected`` is the global model's :func:`tensor_spec` -- from its arrays or, without reading
    them, from its record (``read_record(path).tensors``).
    """
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise UpdateRejected(site, f"tensor names differ from the global model (missing {missing}, unexpected {extra})")
    for name, (dtype, shape) in expected.items():
        arr = params[name]
        if arr.shape != shape:
            raise UpdateRejected(site, f"tensor {name!r} has shape {arr.shape}, the global model has {shape}")
        if str(arr.dtype) != dtype:
            raise UpdateRejected(site, f"tensor {name!r} has dtype {arr.dtype}, the global model has {dtype}")
    bad = all_finite(params)
    if bad is not None:
        raise UpdateRejected(site, f"tensor {bad!r} contains NaN or infinite values")


@dataclass
class RoundOutcome:
    """What a round produced: the new global model and who counted."""

    params: Params
    accepted: dict[str, float]  # site -> effective weight
    rejected: dict[str, str]  # site -> reason
    metrics: dict[str, float]  # sample-weighted mean of the sites' metrics
    site_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    num_samples: int = 0


class FedAvg:
    """Federated averaging weighted by ``num_samples`` x an optional per-site weight.

    FULL updates contribute ``w * params``; DIFF updates contribute ``w * (global + diff)``. The
    result is cast back to each tensor's dtype (integers rounded).
    """

    def __init__(
        self,
        global_params: Params,
        *,
        min_clients: int,
        site_weights: Mapping[str, float] | None = None,
    ) -> None:
        if min_clients < 1:
            raise FlareAirflowError(f"min_clients must be >= 1, got {min_clients}")
        self.global_params = global_params
        self._expected = tensor_spec(global_params)
        self.min_clients = min_clients
        self.site_weights = dict(site_weights or {})
        self._acc = {k: np.zeros(v.shape, dtype=np.float64) for k, v in global_params.items()}
        self._diff_weight = 0.0
        self._total_weight = 0.0
        self._metric_sums: dict[str, float] = {}
        self._metric_weights: dict[str, float] = {}
        self.accepted: dict[str, float] = {}
        self.rejected: dict[str, str] = {}
        self.site_metrics: dict[str, dict[str, float]] = {}
        self.num_samples = 0

    def reject(self, site: str, reason: str) -> None:
        self.rejected[site] = reason

    def add(self, site: str, params: Params, record: ArtifactRecord) -> None:
        """Validate and accumulate one update; on a bad update the site is recorded as rejected."""
        if site in self.accepted or site in self.rejected:
            raise FlareAirflowError(f"site {site!r} already counted in this round")
        try:
            validate_update(site, self._expected, params)
            samples = record.num_samples if record.num_samples is not None else 1
            weight = float(samples) * float(self.site_weights.get(site, 1.0))
            if not weight > 0:
                raise UpdateRejected(site, f"aggregation weight is {weight}; num_samples and weight must be > 0")
        except UpdateRejected as exc:
            self.rejected[site] = exc.reason
            return
        w = np.float64(weight)
        for name, arr in params.items():
            # np.float64 is a strong scalar: the product is float64, never float32.
            self._acc[name] += arr * w
        if record.params_type is ParamsType.DIFF:
            self._diff_weight += weight
        self._total_weight += weight
        self.accepted[site] = weight
        self.num_samples += samples
        self.site_metrics[site] = dict(record.metrics)
        for key, value in record.metrics.items():
            self._metric_sums[key] = self._metric_sums.get(key, 0.0) + value * samples
            self._metric_weights[key] = self._metric_weights.get(key, 0.0) + samples

    def result(self) -> RoundOutcome:
        """The new global model; raises ``QuorumNotReached`` with every failed site's reason."""
        if len(self.accepted) < self.min_clients:
            failed = "; ".join(f"{s}: {r}" for s, r in sorted(self.rejected.items())) or "none reported"
            raise QuorumNotReached(
                f"{len(self.accepted)} valid update(s) from {sorted(self.accepted)}, min_clients is "
                f"{self.min_clients}. Failed sites: {failed}. The global model was not updated."
            )
        out: Params = {}
        for name, ref in self.global_params.items():
            acc = self._acc[name]
            if self._diff_weight:
                acc = acc + ref.astype(np.float64) * self._diff_weight
            mean = acc / self._total_weight
            if ref.dtype.kind in "iu":
                mean = np.rint(mean)
            out[name] = mean.astype(ref.dtype)
        metrics = {k: self._metric_sums[k] / self._metric_weights[k] for k in sorted(self._metric_sums)}
        return RoundOutcome(
            params=out,
            accepted=dict(self.accepted),
            rejected=dict(self.rejected),
            metrics=metrics,
            site_metrics=dict(self.site_metrics),
            num_samples=self.num_samples,
        )


def fedavg_from_store(
    global_params: Params,
    updates: Iterable[tuple[str, WritablePath | None, str | None]],
    *,
    min_clients: int,
    site_weights: Mapping[str, float] | None = None,
) -> RoundOutcome:
    """Stream updates from the store into FedAvg, one in memory at a time.

    ``updates`` yields ``(site, path, failure)``; a site whose job failed passes ``path=None`` and
    the reason. Unreadable or invalid updates make their site rejected for the round.
    """
    agg = FedAvg(global_params, min_clients=min_clients, site_weights=site_weights)
    for site, path, failure in sorted(updates, key=lambda u: u[0]):
        if path is None:
            agg.reject(site, failure or "no update")
            continue
        try:
            params, record = read_artifact(path)
        except FlareAirflowError as exc:
            agg.reject(site, str(exc))
            continue
        agg.add(site, params, record)
        del params
    return agg.result()
