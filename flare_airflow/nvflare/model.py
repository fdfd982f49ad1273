"""The imported job's initial model: NVFlare's inline numpy model, or the user's safetensors file.

Both are checked at import, so a model that cannot train (ragged, not numbers, overflowing float32
to infinity) or a pickle is refused before anything is written, not found at the run's first round.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.tensors import safetensors_layout
from flare_airflow.nvflare.errors import NvflareJobError

NUMPY_KEY = "numpy_key"  # NVFlare's NPConstants.NUMPY_KEY: the numpy jobs' one array
# NVFlare's NPModelPersistor falls back to this array (np_model_persistor.py).
NVFLARE_DEFAULT_MODEL = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _shape(value: Any) -> tuple[int, ...] | str:
    """The shape of nested lists of finite numbers, or why they are not one array of them."""
    if isinstance(value, bool) or not isinstance(value, list | numbers.Real):
        return f"holds {type(value).__name__} {str(value)[:40]!r}, not a number"
    if not isinstance(value, list):
        number = float(value)
        if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
            return f"holds {number!r}, which float32 (NVFlare's model dtype) cannot hold as a finite number"
        return ()
    if not value:
        return "holds an empty list"
    shapes = [_shape(v) for v in value]
    for shape in shapes:
        if isinstance(shape, str):
            return shape
    if len(set(shapes)) != 1:
        return "is ragged (its rows differ in length)"
    first = shapes[0]
    assert not isinstance(first, str)
    return (len(value), *first)


def inline_model(value: Any) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """NPModelPersistor's ``model`` argument as NVFlare holds it (float32), or why it cannot be.

    Checked without recursion past :data:`flare_airflow.nvflare.configs.MAX_DEPTH` (the config
    reader refuses deeper input)."""
    if not isinstance(value, list):
        return None, f"is {type(value).__name__} {str(value)[:40]!r}, not nested lists of numbers"
    shape = _shape(value)
    if isinstance(shape, str):
        return None, shape
    return {NUMPY_KEY: np.asarray(value, dtype=np.float32)}, None


def check_initial_model(path: Path) -> None:
    """``--initial-model``: an existing safetensors file (a pickle is named as such and refused)."""
    if not path.is_file():
        raise NvflareJobError(f"--initial-model {path}: no such file")
    try:
        safetensors_layout(path.read_bytes(), f"--initial-model {path}")
    except OSError as exc:
        raise NvflareJobError(f"--initial-model {path}: cannot read it ({exc.strerror or exc})") from None
    except FlareAirflowError as exc:
        raise NvflareJobError(f"{exc}; give a safetensors file (safetensors.torch.save_file or .numpy)") from None
