"""Aggregation strategies behind one seam (see :mod:`flare_airflow.core.aggregation.strategies.base`).

One module per strategy; :func:`flare_airflow.core.aggregation.engine.aggregate_from_store` runs any of them. Adding a
strategy: a module with a rule (streaming or chunked) or a post-aggregation step, an entry in the
job's ``aggregator`` spec (``core/config/aggregator.py``), and its tests.
"""

from __future__ import annotations

from flare_airflow.core.aggregation.strategies.base import (
    ChunkRule,
    PostStep,
    Rule,
    RuleKind,
    StepContext,
    Strategy,
    StreamingRule,
)
from flare_airflow.core.aggregation.strategies.fedavg import FedAvgRule
from flare_airflow.core.aggregation.strategies.fedprox import FEDPROX_MU_HPARAM, proximal_gradient, proximal_term
from flare_airflow.core.aggregation.strategies.ffa_lora import FfaLoraRule
from flare_airflow.core.aggregation.strategies.krum import Krum
from flare_airflow.core.aggregation.strategies.median import Median
from flare_airflow.core.aggregation.strategies.server_optimizers import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedYogi,
    ServerOptimizer,
)
from flare_airflow.core.aggregation.strategies.trimmed_mean import TrimmedMean

__all__ = [
    "FEDPROX_MU_HPARAM",
    "ChunkRule",
    "FedAdagrad",
    "FedAdam",
    "FedAvgM",
    "FedAvgRule",
    "FedYogi",
    "FfaLoraRule",
    "Krum",
    "Median",
    "PostStep",
    "Rule",
    "RuleKind",
    "ServerOptimizer",
    "StepContext",
    "Strategy",
    "StreamingRule",
    "TrimmedMean",
    "proximal_gradient",
    "proximal_term",
]
