"""FFA-LoRA: the aggregate of the adapters is the exact weighted mean of the sites' weight changes;
plain FedAvg of A and B is not. Through the store engine, as the aggregation task runs it."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from flare_airflow.core.aggregation.engine import aggregate_from_store
from flare_airflow.core.aggregation.strategies import FedAvgRule, FfaLoraRule, Strategy
from flare_airflow.core.config.aggregator import aggregator_spec
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.model import FLModel, ParamsType, write_artifact

RANK, ALPHA, D_IN, D_OUT = 4, 8.0, 24, 16
SCALE = ALPHA / RANK
MODULES = ("layers.0.q_proj", "layers.0.v_proj")
A, B = "{}.lora_A.weight", "{}.lora_B.weight"


def delta_w(params: dict[str, np.ndarray], module: str) -> np.ndarray:
    """LoRA's change to the module's weight: scale * B @ A (float64)."""
    return SCALE * params[B.format(module)].astype(np.float64) @ params[A.format(module)].astype(np.float64)


def adapters(rng: np.random.Generator, a: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    out = {}
    for m in MODULES:
        out[A.format(m)] = a[A.format(m)] if a is not None else rng.standard_normal((RANK, D_IN)).astype(np.float32)
        out[B.format(m)] = rng.standard_normal((D_OUT, RANK)).astype(np.float32)
    return out


def write(tmp: pathlib.Path, updates: list[dict[str, np.ndarray]], samples: list[int]) -> list:
    paths = []
    for i, (params, n) in enumerate(zip(updates, samples, strict=True)):
        path = tmp / f"site-{i}.safetensors"
        write_artifact(path, FLModel(params=params, meta={"num_samples": n}))
        paths.append((f"site-{i}", path, None))
    return paths


SAMPLES = [40, 25, 90]


def test_ffa_lora_merged_delta_w_is_the_weighted_mean_of_the_sites(tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(0)
    glob = adapters(rng)
    glob.update({B.format(m): np.zeros((D_OUT, RANK), np.float32) for m in MODULES})  # PEFT's init: B = 0
    sites = [adapters(rng, a=glob) for _ in SAMPLES]  # A frozen at the shared init, B trained
    outcome, _ = aggregate_from_store(
        Strategy(rule=FfaLoraRule()), glob, write(tmp_path, sites, SAMPLES), min_clients=3
    )
    weights = np.array(SAMPLES, np.float64) / sum(SAMPLES)
    for m in MODULES:
        expected = sum(w * delta_w(site, m) for w, site in zip(weights, sites, strict=True))
        np.testing.assert_allclose(delta_w(outcome.params, m), expected, rtol=0, atol=1e-6)
        assert outcome.params[A.format(m)].tobytes() == glob[A.format(m)].tobytes()  # kept bit for bit


def test_plain_fedavg_of_a_and_b_is_not_the_mean_of_the_sites_delta_w(tmp_path: pathlib.Path) -> None:
    """The inexactness FFA-LoRA removes: with A trained too, mean(B) mean(A) != mean(B A)."""
    rng = np.random.default_rng(1)
    glob = adapters(rng)
    sites = [adapters(rng) for _ in SAMPLES]
    outcome, _ = aggregate_from_store(Strategy(rule=FedAvgRule()), glob, write(tmp_path, sites, SAMPLES), min_clients=3)
    weights = np.array(SAMPLES, np.float64) / sum(SAMPLES)
    for m in MODULES:
        expected = sum(w * delta_w(site, m) for w, site in zip(weights, sites, strict=True))
        assert np.abs(delta_w(outcome.params, m) - expected).max() > 0.1


@pytest.mark.parametrize("params_type", [ParamsType.FULL, ParamsType.DIFF])
def test_a_site_that_trained_a_frozen_matrix_is_rejected(tmp_path: pathlib.Path, params_type: ParamsType) -> None:
    rng = np.random.default_rng(2)
    glob = adapters(rng)
    good, bad = adapters(rng, a=glob), adapters(rng, a=glob)
    bad[A.format(MODULES[1])] = bad[A.format(MODULES[1])] + np.float32(1e-3)
    if params_type is ParamsType.DIFF:
        good = {k: v - glob[k] for k, v in good.items()}
        bad = {k: v - glob[k] for k, v in bad.items()}
    paths = []
    for i, params in enumerate((good, bad)):
        path = tmp_path / f"site-{i}.safetensors"
        write_artifact(path, FLModel(params=params, params_type=params_type, meta={"num_samples": 5}))
        paths.append((f"site-{i}", path, None))
    outcome, _ = aggregate_from_store(Strategy(rule=FfaLoraRule()), glob, paths, min_clients=1)
    assert list(outcome.accepted) == ["site-0"]
    assert "'layers.0.v_proj.lora_A.weight' differs from the global model's" in outcome.rejected["site-1"]
    assert "FFA-LoRA keeps it frozen" in outcome.rejected["site-1"]


def test_the_ffa_lora_block() -> None:
    spec = aggregator_spec({"name": "ffa_lora"})
    assert spec.frozen() == ("*lora_A*",) and spec.label == "FFA-LoRA"
    assert aggregator_spec({"name": "ffa_lora", "freeze": ["*.A"]}).frozen() == ("*.A",)
    assert aggregator_spec({"name": "fedavg"}).frozen() == ()
    with pytest.raises(ValueError, match="norm_bound is not available with ffa_lora"):
        aggregator_spec({"name": "ffa_lora", "norm_bound": 1.0})
    with pytest.raises((ValueError, ConfigError), match="at least one pattern"):
        aggregator_spec({"name": "ffa_lora", "freeze": []})
