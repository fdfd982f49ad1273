"""Central differential privacy as a streaming rule: the store engine's verified reads into
:class:`~flare_airflow.core.privacy.central.CentralDP` (clip each update, noise the sum, divide by
the job's number of sites).

The rule replaces FedAvg's when the job sets ``privacy.central`` (:func:`with_central_dp`); the
job's post-aggregation steps (a server optimizer) still run on its release -- post-processing,
which spends no privacy. Each update is verified exactly as FedAvg's are (the engine's
:class:`~flare_airflow.core.aggregation.update_reader.UpdateReader`: size, digests against the site task's pin,
NaN/inf, names, shapes, dtypes) and folded in one at a time: memory is the float64 sum plus one
update's difference, never every update.

The quorum (``min_clients``) counts the updates that arrived; the denominator is the number of
sites in the job, whoever arrived -- a denominator that depended on who arrived would depend on
the data too (see the module :mod:`flare_airflow.core.privacy.central`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from flare_airflow.core.aggregation.strategies.base import RuleKind, Strategy
from flare_airflow.core.aggregation.tally import RoundOutcome, RoundTally
from flare_airflow.core.aggregation.update_reader import update_weight
from flare_airflow.core.errors import AggregateNotFinite, FlareAirflowError
from flare_airflow.core.model import ParamsType, tensor_spec
from flare_airflow.core.privacy.central import CentralDP
from flare_airflow.core.tensors import is_float

if TYPE_CHECKING:
    from flare_airflow.core.errors import UpdateRejected
    from flare_airflow.core.model import ArtifactRecord, Params


class CentralDPRound:
    """One round's accumulator (the engine's streaming interface) around :class:`CentralDP`."""

    def __init__(self, global_params: Params, *, min_clients: int, rule: CentralDPRule) -> None:
        if min_clients < 1:
            raise FlareAirflowError(f"min_clients must be >= 1, got {min_clients}")
        self.expected = tensor_spec(global_params)
        self.min_clients = min_clients
        self._dp = CentralDP(
            global_params,
            clip=rule.clip,
            noise_multiplier=rule.noise_multiplier,
            num_sites=rule.num_sites,
            key=rule.key,
        )
        self.tally = RoundTally()

    def reject(self, site: str, reason: str) -> None:
        self.tally.reject(site, reason)

    def add_verified(
        self,
        group: Sequence[tuple[str, Params, ArtifactRecord, UpdateRejected | None]],
        run: object = None,
    ) -> None:
        """Clip and sum each verified update of ``group`` in the group's order (sites sorted by the
        engine, so a retry adds in the same order and gets the same float64 sum). ``run`` (the
        engine's threads) is not used: one update's clip needs its whole norm first."""
        for site, params, record, rejected in group:
            self.tally.check_new(site)
            if rejected is None:
                # The weight is not used (every site counts once, clipped), but an unusable
                # num_samples is a bad update here as under FedAvg, and it weights the metrics.
                _, rejected = update_weight(site, record, {})
            if rejected is not None:
                self.tally.reject(site, rejected.reason)
                continue
            self._dp.add(site, params, diff_update=record.params_type is ParamsType.DIFF)
            self.tally.accept(site, record, 1.0)

    def result(self) -> RoundOutcome:
        """The noisy release; raises ``QuorumNotReached`` (every failed site's reason) below ``min_clients``."""
        self.tally.check_quorum(self.min_clients)
        params = self._dp.result()
        for name, values in params.items():
            if is_float(values.dtype) and not np.isfinite(values).all():
                sites = sorted(self.tally.accepted)
                raise AggregateNotFinite(
                    f"the central-DP release of sites {sites} is unusable: tensor {name!r} is not "
                    f"finite in {values.dtype} (overflow). The global model was not updated; lower "
                    "privacy.central.clip or check the global model"
                )
        clip = self._dp.clip
        return self.tally.outcome(
            params, clipped={s: clip / norm for s, norm in sorted(self._dp.norms.items()) if norm > clip}
        )


@dataclasses.dataclass(frozen=True)
class CentralDPRule:
    """Central DP's streaming rule for one round: its clip, noise multiplier, the job's number of
    sites and the round's noise key (:func:`~flare_airflow.core.privacy.central.central_noise_key`)."""

    clip: float
    noise_multiplier: float
    num_sites: int
    key: bytes = dataclasses.field(repr=False)  # never in a log line or an error
    name = "central_dp"
    kind = RuleKind.STREAMING

    def quorum_problem(self, n: int) -> str | None:
        return None if n >= 1 else "central DP needs at least 1 valid update"

    def start(self, global_params: Params, *, min_clients: int, site_weights: Mapping[str, float]) -> CentralDPRound:
        # Site weights do not apply: a weight would scale one site's contribution beyond the clip.
        return CentralDPRound(global_params, min_clients=min_clients, rule=self)


def central_dp_problem(strategy: Strategy) -> str | None:
    """Why central DP cannot replace ``strategy``'s rule, or ``None``.

    A chunked rule (median, trimmed mean, Krum) selects or discards updates by their values, so the
    sum the noise was calibrated for is not what it releases; a norm bound would scale updates the
    clip already bounds (and move the engine onto its chunked path).
    """
    if strategy.rule.kind is not RuleKind.STREAMING:
        return (
            f"privacy.central (central DP) cannot be combined with the robust aggregation rule "
            f"{strategy.rule.name!r}: its noise is calibrated to the clipped sum of all updates, and a robust rule "
            "releases a selection of them instead; use aggregator fedavg with central DP, or drop privacy.central"
        )
    if strategy.norm_bound is not None:
        return (
            "privacy.central: aggregator.norm_bound cannot be combined with central DP, which clips every update "
            "to privacy.central.clip already (its noise is calibrated to that clip, not to a norm bound); remove "
            "aggregator.norm_bound"
        )
    return None


def with_central_dp(
    strategy: Strategy, *, clip: float, noise_multiplier: float, num_sites: int, key: bytes
) -> Strategy:
    """``strategy`` with central DP as its rule (its post-aggregation steps kept); refused with
    :func:`central_dp_problem`'s reason (the job's validation gives the same one at parse time)."""
    problem = central_dp_problem(strategy)
    if problem is not None:
        raise FlareAirflowError(problem)
    rule = CentralDPRule(clip=clip, noise_multiplier=noise_multiplier, num_sites=num_sites, key=key)
    return dataclasses.replace(strategy, rule=rule)
