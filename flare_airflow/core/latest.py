"""The job's ``latest.json``: which run's final model a warm start continues from.

``publish`` writes it; ``prepare`` reads it back, key by key, and verifies the model it names.
"""

from __future__ import annotations

import json
from typing import Any

from flare_airflow.core.digests import HEX_DIGEST
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.model import Params, read_artifact
from flare_airflow.core.store import ModelStore

_POINTER_KEYS = {"run_id": str, "model_uri": str, "sha256": str, "round": int}


def parse_latest_pointer(data: bytes, where: str) -> dict[str, Any]:
    """The job's ``latest.json`` (written by :class:`~flare_airflow.operators.publish.PublishOperator`),
    checked key by key."""
    try:
        latest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FlareAirflowError(f"{where} is not valid JSON ({str(exc)[:100]})") from None
    if not isinstance(latest, dict):
        raise FlareAirflowError(f"{where} must hold a JSON object, got {type(latest).__name__}")
    for key, kind in _POINTER_KEYS.items():
        value = latest.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise FlareAirflowError(
                f"{where}: {key!r} is {'missing' if key not in latest else 'not a ' + kind.__name__} "
                f"(expected keys: {', '.join(_POINTER_KEYS)})"
            )
    if not HEX_DIGEST.match(latest["sha256"]):
        raise FlareAirflowError(f"{where}: 'sha256' is not 64 hex digits")
    return latest


def warm_start_model(store: ModelStore, pointer: Any) -> tuple[Params, str]:
    """The final model of the job's last successful run, verified against the pointer's sha256."""
    with pointer.open("rb") as fh:
        latest = parse_latest_pointer(fh.read(1 << 20), str(pointer))
    path = store.resolve_uri(latest["model_uri"])
    model_params, record = read_artifact(path)
    if record.sha256 != latest["sha256"]:
        raise FlareAirflowError(f"{path} changed since run {latest['run_id']} published it")
    return model_params, f"warm start from run {latest['run_id']} ({latest['model_uri']})"
