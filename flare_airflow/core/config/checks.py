"""Checks that read more than the job file: the initial model's tensors, the store's fsspec backend.

``load_job`` only checks that files exist (every task process parses the job); these run where a
run starts (the CLI, the run's ``prepare`` task).
"""

from __future__ import annotations

import fnmatch
import pathlib
from typing import Any

from flare_airflow.core.config.describe import clip
from flare_airflow.core.config.job import JobConfig
from flare_airflow.core.errors import ConfigError, FlareAirflowError


def load_initial_model(job: JobConfig) -> dict[str, Any]:
    """The job's ``initial_model`` as tensors, checked as a run checks it (strict safetensors, finite).

    ``load_job`` only checks that the file exists (every task process parses the job); this reads
    it. Raises ``ConfigError`` naming the field, the file and what is wrong.
    """
    path = job.initial_model_path()
    params = load_model_file(path, f"initial_model {job.initial_model!r} ({path})")
    check_exclude(job, params, f"initial_model {job.initial_model!r}")
    return params


def check_exclude(job: JobConfig, params: dict[str, Any], model: str) -> None:
    """Every ``aggregator.exclude`` pattern names at least one tensor of the model: a pattern that
    matches nothing (a typo, another model's names) would let the server optimizer move the very
    tensors (batch-norm statistics ...) it was meant to leave to plain averaging."""
    names = sorted(params)
    for pattern in job.aggregator.excluded():
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ConfigError(
                f"aggregator.exclude: pattern {pattern!r} matches no tensor of {model} (its tensors: "
                f"{clip(', '.join(names), 200)}); patterns are case-sensitive globs over whole names, "
                "e.g. '*running_mean': fix it or remove it"
            )


def load_model_file(path: pathlib.Path, where: str) -> dict[str, Any]:
    """A plain safetensors file's tensors, checked as a run checks an initial model; errors start with ``where``."""
    # numpy loads here, not when a task process merely parses its job
    from flare_airflow.core.model import all_finite, parse_safetensors

    try:
        params = parse_safetensors(path.read_bytes(), str(path))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except FlareAirflowError as exc:
        raise ConfigError(f"{where}: {clip(str(exc).removeprefix(f'{path}: '), 300)}") from None
    if not params:
        raise ConfigError(f"{where}: holds no tensors; save the model's initial weights (safetensors.numpy.save_file)")
    bad = all_finite(params)
    if bad is not None:
        raise ConfigError(f"{where}: tensor {bad!r} has NaN or infinite values; the first round would publish them")
    return params


def check_store_backend(job: JobConfig) -> None:
    """The store's URI scheme has its fsspec backend installed here (a run would fail without it)."""
    scheme = job.store_scheme
    if scheme == "file":
        return
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ConfigError(
            f"store {job.store!r}: the {scheme}:// backend is not installed here ({clip(str(exc), 160)}); "
            "install it (e.g. the matching Airflow provider) on every machine that runs tasks"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"store {job.store!r}: {clip(str(exc), 160)}") from None
