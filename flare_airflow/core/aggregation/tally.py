"""One round's tally, kept once for every rule: who counted with which weight, who was refused and
why, and the sample-weighted mean of the sites' metrics.

Streaming FedAvg (:class:`~flare_airflow.core.aggregation.streaming.FedAvg`), the chunked rules
(:func:`~flare_airflow.core.aggregation.engine.chunked_from_store`) and central DP
(:class:`~flare_airflow.core.aggregation.central_dp.CentralDPRound`) differ in the maths only; the
bookkeeping around it -- and so the round's record, XCom and failure message -- is this class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flare_airflow.core.errors import FlareAirflowError, QuorumNotReached
from flare_airflow.core.model import MAX_METRICS, ArtifactRecord, Params


@dataclass
class RoundOutcome:
    """What a round produced: the new global model and who counted."""

    params: Params
    accepted: dict[str, float]  # site -> effective weight
    rejected: dict[str, str]  # site -> reason
    metrics: dict[str, float]  # sample-weighted mean of the sites' metrics
    site_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    num_samples: int = 0
    metrics_dropped: list[str] = field(default_factory=list)  # means left out: more than MAX_METRICS names
    selected: list[str] | None = None  # the sites a selecting rule (Krum) combined; None: every accepted site
    clipped: dict[str, float] = field(default_factory=dict)  # site -> factor its update was scaled by (norm bound)


def failed_sites(rejected: Mapping[str, str]) -> str:
    """Every rejected site with its reason, for a round's failure message."""
    return "; ".join(f"{s}: {r}" for s, r in sorted(rejected.items())) or "none reported"


def below_quorum(valid: Sequence[str], min_clients: int, rejected: Mapping[str, str]) -> QuorumNotReached:
    """The one message of a round with fewer valid updates than ``min_clients``, whatever the rule."""
    return QuorumNotReached(
        f"{len(valid)} valid update(s) from {list(valid)}, min_clients is {min_clients}. "
        f"Failed sites: {failed_sites(rejected)}. The global model was not updated."
    )


def round_metrics(sums: Mapping[str, float], weights: Mapping[str, float]) -> tuple[dict[str, float], list[str]]:
    """The round's sample-weighted metric means, and the names left out of them.

    Each site's metrics are finite, but their sample-weighted sum may not be: such a mean is left out.
    Each site sends at most ``MAX_METRICS``, but sites may name different ones: the round (one
    artifact record, one XCom) keeps the ones reported for the most samples.
    """
    metrics = {k: sums[k] / weights[k] for k in sorted(sums)}
    metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
    dropped: list[str] = []
    if len(metrics) > MAX_METRICS:
        kept = sorted(metrics, key=lambda k: (-weights[k], k))[:MAX_METRICS]
        dropped = sorted(set(metrics) - set(kept))
        metrics = {k: metrics[k] for k in sorted(kept)}
    return metrics, dropped


class RoundTally:
    """Who counted in one round, in the order they were counted."""

    def __init__(self) -> None:
        self.accepted: dict[str, float] = {}  # site -> effective weight
        self.rejected: dict[str, str] = {}  # site -> reason
        self.site_metrics: dict[str, dict[str, float]] = {}
        self.num_samples = 0
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}

    def counted(self, site: str) -> bool:
        """Whether ``site`` was accepted or rejected already."""
        return site in self.accepted or site in self.rejected

    def check_new(self, site: str) -> None:
        """Refuse a second update of one site in one round (the store holds one per site)."""
        if self.counted(site):
            raise FlareAirflowError(f"site {site!r} already counted in this round")

    def reject(self, site: str, reason: str) -> None:
        self.rejected[site] = reason

    def accept(self, site: str, record: ArtifactRecord, weight: float) -> None:
        """Count ``site`` with ``weight``; its metrics weigh by its samples (1 when it gave none)."""
        samples = record.num_samples if record.num_samples is not None else 1
        self.accepted[site] = weight
        self.num_samples += samples
        self.site_metrics[site] = dict(record.metrics)
        for key, value in record.metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + value * samples
            self._weights[key] = self._weights.get(key, 0.0) + samples

    def failed(self) -> str:
        return failed_sites(self.rejected)

    def check_quorum(self, min_clients: int) -> None:
        """Raise ``QuorumNotReached`` naming every failed site when fewer than ``min_clients`` counted."""
        if len(self.accepted) < min_clients:
            raise below_quorum(sorted(self.accepted), min_clients, self.rejected)

    def outcome(
        self,
        params: Params,
        *,
        selected: list[str] | None = None,
        clipped: Mapping[str, float] | None = None,
    ) -> RoundOutcome:
        """The round's outcome with ``params`` as its new global model."""
        metrics, dropped = round_metrics(self._sums, self._weights)
        return RoundOutcome(
            params=params,
            accepted=dict(self.accepted),
            rejected=dict(self.rejected),
            metrics=metrics,
            site_metrics=dict(self.site_metrics),
            num_samples=self.num_samples,
            metrics_dropped=dropped,
            selected=selected,
            clipped=dict(clipped or {}),
        )
