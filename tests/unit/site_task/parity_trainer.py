"""A trainer that sends one kind of update, named by its argument: the rows of the parity test
(tests/unit/site_task/test_try_trainer_parity.py). The test writes the same update for the site
task with :func:`write_update`, so both sides get identical bytes from identical code."""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np

from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.store import record_path

KINDS = ("good", "clipped", "wrong_shape", "nan", "symlink", "private_metric", "renamed", "none")


def write_update(kind: str, out: pathlib.Path, global_model: pathlib.Path) -> None:
    """Send update ``kind`` at ``out`` (the trainer's FLARE_OUTPUT), made from ``global_model``."""
    w = read_artifact(global_model)[0]["w"]
    metrics = {"loss": 0.3}
    params = {"w": w + np.float32(0.1)}
    if kind == "none":
        return
    if kind == "clipped":  # L2 norm 20: the site's gaussian filter clips it to 0.5
        params = {"w": w + np.float32(10.0)}
    elif kind == "wrong_shape":
        params = {"w": np.zeros(w.size + 1, np.float32)}
    elif kind == "nan":
        params = {"w": np.full_like(w, np.nan)}
    elif kind == "private_metric":
        metrics = {"loss": 0.3, "patients_seen": 17.0}
    elif kind == "renamed":
        params = {"weights": params["w"]}
    if kind == "symlink":  # a real update next door, and the sent name a link to it
        elsewhere = out.parent / "elsewhere.safetensors"
        write_artifact(elsewhere, FLModel(params=params, metrics=metrics, meta={"num_samples": 1}))
        out.symlink_to(elsewhere)
        record_path(out).write_bytes(record_path(elsewhere).read_bytes())
        return
    write_artifact(out, FLModel(params=params, metrics=metrics, meta={"num_samples": 1}))


if __name__ == "__main__":
    write_update(sys.argv[1], pathlib.Path(os.environ["FLARE_OUTPUT"]), pathlib.Path(os.environ["FLARE_GLOBAL_MODEL"]))
