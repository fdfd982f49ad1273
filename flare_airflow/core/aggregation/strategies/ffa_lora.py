"""FFA-LoRA: federated LoRA with the A matrices frozen, so that averaging the adapters is exact.

With LoRA, a site's change to a weight matrix is ``ΔW_i = s · B_i A_i`` (``s = alpha / rank``). Plain
FedAvg of A and B, as most federated LoRA stacks do, gives ``s · mean(B) mean(A)``, which is not
``mean(ΔW_i) = s · mean(B_i A_i)``: the product of means is not the mean of products. FFA-LoRA (Sun,
Qin, Li, Ding: "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024) freezes every A
at the shared initialisation and trains only B; then ``mean(ΔW_i) = s · mean(B_i) A`` exactly, and
FedAvg of B is the exact aggregate.

This rule is FedAvg plus the guarantee the exactness rests on: an update whose frozen tensors
differ from the global model's (FULL) or are not zero (DIFF) is rejected, naming the tensor, and the
new global model keeps the frozen tensors bit for bit (a float64 mean of equal values may round).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from flare_airflow.core.aggregation.strategies.fedavg import FedAvgRule
from flare_airflow.core.aggregation.streaming import FedAvg, PieceStep, RoundOutcome
from flare_airflow.core.errors import UpdateRejected
from flare_airflow.core.model import ArtifactRecord, Params, ParamsType

DEFAULT_FROZEN = ("*lora_A*",)  # PEFT's names: base_model.model....q_proj.lora_A.weight


def frozen_names(names: Sequence[str], patterns: Sequence[str]) -> list[str]:
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


class FrozenFedAvg(FedAvg):
    """FedAvg that refuses updates changing the frozen tensors and keeps them exactly."""

    def __init__(self, global_params: Params, *, frozen: Sequence[str], **kwargs: object) -> None:
        super().__init__(global_params, **kwargs)  # type: ignore[arg-type]
        self.frozen = frozen_names(list(global_params), frozen)

    def _changed(self, params: Params, record: ArtifactRecord) -> str | None:
        for name in self.frozen:
            got = params[name]
            if record.params_type is ParamsType.DIFF:
                if np.any(got.astype(np.float64) != 0):
                    return name
            elif got.tobytes() != self.global_params[name].tobytes():
                return name
        return None

    def add_verified(
        self,
        group: Sequence[tuple[str, Params, ArtifactRecord, UpdateRejected | None]],
        run: Callable[[Sequence[Callable[[], None]]], object] | None = None,
    ) -> None:
        checked = []
        for site, params, record, rejected in group:
            if rejected is None and (name := self._changed(params, record)) is not None:
                rejected = UpdateRejected(
                    site,
                    f"tensor {name!r} differs from the global model's, but FFA-LoRA keeps it frozen at the shared "
                    "initialisation (only B is trained); freeze the LoRA A matrices in the trainer "
                    "(the Client API's get_lora()['frozen'] names them)",
                )
            checked.append((site, params, record, rejected))
        super().add_verified(checked, run)

    def result(self, step: PieceStep | None = None) -> RoundOutcome:
        outcome = super().result(step)
        for name in self.frozen:
            outcome.params[name] = self.global_params[name].copy()
        return outcome


class FfaLoraRule(FedAvgRule):
    """FedAvg of the trained adapter tensors; the ``frozen`` ones (glob patterns) stay the global model's."""

    name = "ffa_lora"

    def __init__(self, frozen: Sequence[str] = DEFAULT_FROZEN) -> None:
        self.frozen = tuple(frozen)

    def start(self, global_params: Params, *, min_clients: int, site_weights: Mapping[str, float]) -> FedAvg:
        return FrozenFedAvg(global_params, frozen=self.frozen, min_clients=min_clients, site_weights=site_weights)
