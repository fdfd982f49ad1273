"""What a site job asks for (``resource_spec``) and how a site's GPUs are managed (``resource_manager``)."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator

from flare_airflow.core.config.describe import short_repr
from flare_airflow.core.config.validators import Strict


class ResourceSpec(Strict):
    """What one site job asks for (NVFlare ``resource_spec``)."""

    num_of_gpus: int = Field(0, ge=0, le=1024, description="GPUs per site job")
    num_of_cpus: float | None = Field(None, gt=0, le=4096, description="CPU cores per site job")
    memory: str | None = Field(None, description="memory per site job, e.g. '4Gi'")
    mem_per_gpu_in_GiB: float | None = Field(None, ge=0, le=1e6, description="free GPU memory needed per GPU")

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError(f"must be a quantity like '512Mi', '4Gi' or '2G', got {short_repr(value)}")
        text = str(value)
        match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([EPTGMK]i?|[eE][0-9]+)?", text)
        if not match:
            raise ValueError(f"{short_repr(text)} is not a quantity like '512Mi', '4Gi' or '2G'")
        if _quantity_bytes(match.group(1), match.group(2) or "") < 1:
            raise ValueError(f"{text!r} is less than one byte: give the memory a site job needs, e.g. '4Gi'")
        if _quantity_bytes(match.group(1), match.group(2) or "") > 2**63 - 1:
            raise ValueError(f"{short_repr(text)} is more memory than any machine has (at most 8Ei)")
        return text


_QUANTITY_SUFFIXES = {
    "": 1,
    **{s: 1000**i for i, s in enumerate("KMGTPE", start=1)},
    **{s + "i": 1024**i for i, s in enumerate("KMGTPE", start=1)},
}


def quantity_bytes(text: str) -> float:
    """Bytes of a validated ``memory`` quantity such as ``'4Gi'``, ``'512M'`` or ``'2e9'``."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([EPTGMK]i?|[eE][0-9]+)?", text)
    if not match:
        raise ValueError(f"{text!r} is not a quantity like '512Mi', '4Gi' or '2G'")
    return _quantity_bytes(match.group(1), match.group(2) or "")


def _quantity_bytes(number: str, suffix: str) -> float:
    if suffix[:1] in ("e", "E") and suffix[1:].isdigit():
        exponent = int(suffix[1:])
        return math.inf if exponent > 30 else float(number) * 10.0**exponent
    return float(number) * _QUANTITY_SUFFIXES[suffix]


class ResourceManagerSpec(Strict):
    """How a site's GPUs are managed (NVFlare's resource managers).

    ``gpu``: the site has ``num_of_gpus`` GPUs; an Airflow pool with that many slots bounds its
    concurrent jobs, and each job gets its own devices. ``passthrough``: no pool; the backend
    (Kubernetes, SLURM) enforces the limits itself.
    """

    type: Literal["gpu", "passthrough"] = "gpu"
    num_of_gpus: int = Field(0, ge=0, le=4096, description="GPUs the site has (pool slots)")
    gpu_class: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,30}$", description="e.g. 'a100'")
    pool: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,256}$", description="Airflow pool name")
    ignore_host: bool = Field(False, description="do not assign local devices (jobs run on other machines)")
