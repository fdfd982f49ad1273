"""What crosses between an NVFlare script's objects and flare-airflow's update: torch tensors or
numpy arrays to numpy (bit-exact), numpy back to torch, a FULL model as its DIFF to the received
one, metrics to floats, NVFlare's meta to the update's (``NUM_STEPS_CURRENT_ROUND`` is the FedAvg
weight). Errors say what was sent and what to send instead."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from flare_airflow.core.errors import ClientAPIError
from flare_airflow.core.nvflare.fl_model import FLMetaKey


def is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def to_numpy(params: Any, what: str) -> dict[str, np.ndarray]:
    if not isinstance(params, Mapping):
        raise ClientAPIError(
            f"FLModel.{what} must be a dict of arrays (or a torch state_dict), got {type(params).__name__}"
        )
    out: dict[str, np.ndarray] = {}
    for name, value in params.items():
        if is_torch(value):
            value = value.detach().cpu()
            if str(value.dtype) == "torch.bfloat16":
                raise ClientAPIError(
                    f"FLModel.{what}[{name!r}] is a bfloat16 tensor, which numpy cannot hold: "
                    "send float32 (tensor.float()) or float16"
                )
            out[name] = np.ascontiguousarray(value.numpy())
        else:
            out[name] = np.asarray(value)
    return out


def to_torch(params: dict[str, Any]) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        raise ClientAPIError(
            "this job exchanges params as pytorch tensors, but torch is not importable in the trainer's "
            "environment: install torch there, or set the job's trainer.nvflare.params_exchange to numpy"
        ) from None
    # A copy: the arrays read from the store may be read-only, and torch tensors are writable.
    return {name: torch.from_numpy(np.array(value)) for name, value in params.items()}


def diff_from(params: dict[str, np.ndarray], received: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``new - received`` per name, in the sent dtype. A name only one side has is an error here
    (NVFlare drops it): the aggregation needs every tensor of the global model."""
    if set(params) != set(received):
        odd = sorted(set(params) ^ set(received))[:5]
        raise ClientAPIError(
            f"the job's transfer type is DIFF, but the params sent and the global model received differ in {odd}: "
            "a DIFF needs the same names as the model received"
        )
    return {name: np.subtract(value, received[name], dtype=value.dtype) for name, value in params.items()}


def scalar(value: Any, key: str) -> float:
    if is_torch(value) or isinstance(value, np.generic | np.ndarray):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClientAPIError(f"metric {key!r} is {type(value).__name__}; a round's metrics are numbers")
    return float(value)


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {str(key): scalar(value, str(key)) for key, value in metrics.items()}


def update_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """NVFlare's meta as the update's meta: NUM_STEPS_CURRENT_ROUND becomes num_samples (the weight)."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if key == FLMetaKey.NUM_STEPS_CURRENT_ROUND:
            steps = value.item() if is_torch(value) or isinstance(value, np.generic) else value
            if isinstance(steps, float) and math.isfinite(steps) and steps.is_integer():
                steps = int(steps)
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise ClientAPIError(
                    f"meta[{FLMetaKey.NUM_STEPS_CURRENT_ROUND!r}] is {steps!r}: it is this update's FedAvg weight "
                    "and must be a whole number >= 1 (the number of training steps or samples)"
                )
            out["num_samples"] = steps
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue  # the update's record is JSON: objects that are not stay in the trainer
        out[str(key)] = value
    return out
