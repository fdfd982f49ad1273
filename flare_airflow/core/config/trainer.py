"""The job's trainer: its command, its hyperparameters and the ranges the run form allows, and
NVIDIA FLARE Client API compatibility."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flare_airflow.core.config.describe import short_repr
from flare_airflow.core.config.validators import (
    MAX_FORM_INT,
    MAX_SECONDS,
    Scalar,
    Strict,
    argv,
    no_nul,
    not_blank,
)

_HPARAM_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}\Z")


class NvflareCompat(Strict):
    """Run the trainer as an unmodified NVIDIA FLARE Client API script (``import nvflare.client``)."""

    params_exchange: Literal["numpy", "pytorch"] = Field(
        "numpy", description="what flare.receive() hands the script: numpy arrays or torch tensors"
    )
    transfer: Literal["FULL", "DIFF"] = Field(
        "FULL", description="DIFF: a FULL update is sent as its difference to the received model (NVFlare's DIFF)"
    )


class HparamRange(Strict):
    """Bounds of a numeric hyper-parameter: the trigger form shows them and refuses values outside
    (a typed number), ``prepare`` refuses them whatever the form or the REST API sent."""

    min: float | None = Field(None, description="smallest allowed value (inclusive)")
    max: float | None = Field(None, description="largest allowed value (inclusive)")

    @model_validator(mode="after")
    def _bounds(self) -> HparamRange:
        for name, bound in (("min", self.min), ("max", self.max)):
            if bound is not None and not math.isfinite(bound):
                raise ValueError(f"{name} must be a finite number, got {bound!r}")
        if self.min is None and self.max is None:
            raise ValueError("give min, max or both, e.g. {min: 0.0, max: 1.0}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min!r} is greater than max {self.max!r}")
        return self

    def refusal(self, value: float) -> str | None:
        """Why ``value`` is outside the range, or None."""
        if self.min is not None and value < self.min:
            return f"is below the job's minimum {self.min!r}"
        if self.max is not None and value > self.max:
            return f"is above the job's maximum {self.max!r}"
        return None


class TrainerSpec(Strict):
    """The trainer: a script run as an exact argv ``command + [script] + args`` (never a shell)."""

    script: str = Field(description="trainer script, relative to the job file")
    args: list[str] = Field(default_factory=list, description="arguments, passed literally")
    command: list[str] = Field(default_factory=list, description="command prefix; default: this Python")
    hparams: dict[str, Scalar] = Field(default_factory=dict, description="hyper-parameters (UI form fields)")
    hparam_ranges: dict[str, HparamRange] = Field(
        default_factory=dict, description="min/max of numeric hyper-parameters, enforced by the form and prepare"
    )
    launch_timeout: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="seconds for the trainer to call receive(); unlimited by default"
    )
    shutdown_timeout: float = Field(10.0, ge=0, le=3600, description="grace between SIGTERM and SIGKILL")
    timeout: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="seconds a site job may run (execution timeout)"
    )
    nvflare: NvflareCompat | None = Field(
        None, description="run an NVFlare Client API script through flare-airflow's nvflare stand-in"
    )

    @field_validator("args", "command", mode="before")
    @classmethod
    def _argv(cls, value: Any) -> Any:
        return argv(value)

    @field_validator("script")
    @classmethod
    def _script(cls, value: str) -> str:
        return not_blank(
            value, "trainer.script", "must name the trainer script, e.g. 'train.py' (relative to the job file)"
        )

    @field_validator("hparams", mode="before")
    @classmethod
    def _hparams(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        for key, item in value.items():
            if not isinstance(key, str) or not _HPARAM_KEY.match(key):
                raise ValueError(
                    f"hyper-parameter name {short_repr(key)} is not allowed: use letters, digits and '_', "
                    "starting with a letter (it becomes the trigger form field hp_<name>)"
                )
            what = f"hyper-parameter {key!r}"
            if isinstance(item, str):
                no_nul(item, what)
                continue
            if isinstance(item, bool):
                continue
            if isinstance(item, int):
                if abs(item) > MAX_FORM_INT:
                    raise ValueError(f"{what} is {short_repr(item)}: integers must be within +-2**53 (the form's JSON)")
            elif isinstance(item, float):
                if not math.isfinite(item):
                    raise ValueError(f"{what} is {item!r}: hyper-parameters must be finite numbers")
            else:
                raise ValueError(
                    f"{what} must be a number, a string or true/false, got {type(item).__name__} "
                    f"{short_repr(item)} (the trigger form has one field per hyper-parameter)"
                )
        return value

    @model_validator(mode="after")
    def _ranges(self) -> TrainerSpec:
        for key, bounds in self.hparam_ranges.items():
            if key not in self.hparams:
                raise ValueError(
                    f"hparam_ranges: {key!r} is not one of the hyper-parameters ({', '.join(self.hparams) or 'none'})"
                )
            default = self.hparams[key]
            if isinstance(default, bool) or not isinstance(default, int | float):
                raise ValueError(f"hparam_ranges: {key!r} has the non-numeric default {short_repr(default)}")
            if why := bounds.refusal(default):
                raise ValueError(f"hparam_ranges: the default of {key!r}, {default!r}, {why}")
        return self
