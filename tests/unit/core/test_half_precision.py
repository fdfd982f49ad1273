"""Half precision travels as it is: bf16 / fp16 tensors are stored, verified and validated in their own
dtype (never upcast on the way), and aggregated in float64 before the one rounding back."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from flare_airflow.core.aggregation.streaming import fedavg_from_store
from flare_airflow.core.model import FiniteScan, FLModel, all_finite, read_artifact, read_into, write_artifact
from flare_airflow.core.privacy.filters import clip_in_place, l2_norm
from flare_airflow.core.tensors import BFLOAT16, is_float, is_inexact

BF16 = np.dtype(ml_dtypes.bfloat16)


def half_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "lora_A": rng.standard_normal((4, 16)).astype(BF16),
        "lora_B": rng.standard_normal((16, 4)).astype(np.float16),
    }


def test_bf16_and_fp16_round_trip_without_upcast(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "adapter.safetensors"
    params = half_params()
    record = write_artifact(path, FLModel(params=params))
    assert record.tensors == {"lora_A": ("bfloat16", (4, 16)), "lora_B": ("float16", (16, 4))}
    assert record.size == 8 + int.from_bytes(path.read_bytes()[:8], "little") + 2 * 64 + 2 * 64  # 2 bytes each
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert {k: v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"lora_A": "BF16", "lora_B": "F16"}
    got, _ = read_artifact(path)
    for name, arr in params.items():
        assert got[name].dtype == arr.dtype
        assert got[name].tobytes() == arr.tobytes()
    # Byte for byte the file safetensors itself writes (what torch's loader reads as torch.bfloat16).
    assert path.read_bytes() == safetensors.numpy.save(params, metadata={"params_type": "FULL"})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_bf16_element_is_found_by_every_check(tmp_path: pathlib.Path, bad: float) -> None:
    params = half_params()
    params["lora_A"].reshape(-1)[-1] = bad
    assert all_finite(params) == "lora_A"
    path = tmp_path / "adapter.safetensors"
    record = write_artifact(path, FLModel(params=params))
    scan = FiniteScan()
    read_into(path, record.size, None, scan)
    assert scan.bad == "lora_A"


def test_bf16_is_a_float_to_every_float_test() -> None:
    # numpy files bfloat16 under kind 'V': tests of dtype.kind alone would skip it.
    assert BFLOAT16 == BF16 and BF16.kind == "V"
    assert is_float(BF16) and is_inexact(BF16) and is_float(np.dtype(np.float16))
    assert not is_float(np.dtype(np.complex64)) and is_inexact(np.dtype(np.complex64))
    assert not is_float(np.dtype(np.int16)) and not is_float(np.dtype(np.uint16))


def test_site_clipping_reaches_bf16_tensors() -> None:
    diff = {"a": np.full(4, 3.0, BF16), "b": np.full(4, 4.0, np.float32)}
    norm, clipped = clip_in_place(diff, 1.0)
    assert norm == pytest.approx(10.0) and clipped
    assert diff["a"].dtype == BF16
    assert l2_norm(diff) == pytest.approx(1.0, rel=1e-2)


def write_updates(tmp: pathlib.Path, updates: list[dict[str, np.ndarray]], samples: list[int]) -> list:
    out = []
    for i, (params, n) in enumerate(zip(updates, samples, strict=True)):
        path = tmp / f"site-{i}.safetensors"
        write_artifact(path, FLModel(params=params, meta={"num_samples": n}))
        out.append((f"site-{i}", path, None))
    return out


def test_fedavg_of_half_updates_sums_in_float64_and_rounds_once(tmp_path: pathlib.Path) -> None:
    glob = {k: np.zeros_like(v) for k, v in half_params().items()}
    updates = [half_params(seed) for seed in (1, 2, 3)]
    samples = [3, 5, 11]
    outcome = fedavg_from_store(glob, write_updates(tmp_path, updates, samples), min_clients=3)
    for name, ref in glob.items():
        exact = sum(u[name].astype(np.float64) * n for u, n in zip(updates, samples, strict=True)) / sum(samples)
        got = outcome.params[name]
        assert got.dtype == ref.dtype
        assert got.tobytes() == exact.astype(ref.dtype).tobytes(), name
    # Summing in the half dtype itself would round at every step and give other bits.
    naive = (updates[0]["lora_A"] * BF16.type(3) + updates[1]["lora_A"] * BF16.type(5)) + updates[2][
        "lora_A"
    ] * BF16.type(11)
    assert (naive / BF16.type(19)).tobytes() != outcome.params["lora_A"].tobytes()


def test_an_upcast_update_is_refused_not_cast_down(tmp_path: pathlib.Path) -> None:
    glob = {k: np.zeros_like(v) for k, v in half_params().items()}
    good = half_params(1)
    upcast = {k: v.astype(np.float32) for k, v in half_params(2).items()}
    outcome = fedavg_from_store(glob, write_updates(tmp_path, [good, upcast], [1, 1]), min_clients=1)
    assert list(outcome.accepted) == ["site-0"]
    assert "has dtype float32, the global model has bfloat16" in outcome.rejected["site-1"]
