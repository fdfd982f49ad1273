"""Native mode's submit token and the global model read from a finished FLARE job's result."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from flare_airflow.core.errors import ModelFormatError
from flare_airflow.core.tensors import Params, all_finite, is_float, parse_safetensors
from flare_airflow.nvflare_native.errors import FlareResultError

NUMPY_KEY = "numpy_key"  # NVFlare's NPConstants.NUMPY_KEY: NPModelPersistor's one array
# Where NVFlare's persistors leave the final global model in the server's job workspace.
DEFAULT_MODEL_FILE = "models/server.npy"


def submit_token(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """FLARE's submit token for one Airflow task of one DAG run: the same for every try of it.

    FLARE accepts ``[A-Za-z0-9._:-]{1,128}``; DAG and run ids may hold other characters and be
    longer, so the identity is hashed (and the bridge appends ``.<generation>``).
    """
    identity = "\x00".join((dag_id, run_id, task_id, str(map_index)))
    return "flare-airflow:" + hashlib.sha256(identity.encode()).hexdigest()[:40]


def read_global_model(result_dir: Path, model_file: str = DEFAULT_MODEL_FILE, key: str = NUMPY_KEY) -> Params:
    """The global model in a downloaded job result: a ``.npy`` array (read without pickle, stored
    under ``key``) or a ``.safetensors`` file. Anything else is refused: flare-airflow never unpickles."""
    candidates = [result_dir / model_file, result_dir / "workspace" / model_file]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise FlareResultError(
            f"the FLARE job's result {result_dir} has no {model_file}: the server's persistor saved the global "
            "model elsewhere or not at all; name its file with model_file= (relative to the server's job workspace)"
        )
    if path.suffix == ".safetensors":
        try:
            params = parse_safetensors(path.read_bytes(), str(path))  # the house's strict parser
        except ModelFormatError as exc:
            raise FlareResultError(str(exc)) from None
        bad = all_finite(params)
        if bad:
            raise FlareResultError(
                f"{path}: tensor {bad!r} holds NaN or infinite values: the global model is not published"
            )
        return params
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise FlareResultError(
                f"{path} holds Python objects (a pickled array): flare-airflow never unpickles a model ({exc})"
            ) from None
        if array.dtype.kind not in "fiub":
            raise FlareResultError(f"{path} holds a {array.dtype} array, not numbers")
        if is_float(array.dtype) and not np.isfinite(array).all():
            raise FlareResultError(f"{path} holds NaN or infinite values: the global model is not published")
        return {key: np.ascontiguousarray(array)}
    raise FlareResultError(
        f"{path}: flare-airflow reads FLARE global models saved as .npy (NPModelPersistor) or .safetensors; "
        f"a {path.suffix or 'suffix-less'} file (e.g. PyTorch's pickled .pt) is refused -- save it as safetensors"
    )
