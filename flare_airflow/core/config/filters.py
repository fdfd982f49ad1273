"""The site-side privacy filters of the job file and the site policy: one entry per filter.

One class per filter, told apart by ``type`` (a discriminated union, as the strategies are): each
validates its own parameters and names the site filter it configures (``applies``, a class of the
``FILTERS`` registry in :mod:`flare_airflow.core.privacy.filters`), whose parameters are its fields.
The union is the job file's registry (:data:`FILTER_SPECS`): ``allow_job_filters`` and
``skip_site_filters`` name its types, and nothing chooses a filter by comparing its type.
"""

from __future__ import annotations

import re
import typing
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from flare_airflow.core.config.validators import Strict, is_real_number, positive_number
from flare_airflow.core.privacy.filters import (
    ClipFilter,
    ExcludeVarsFilter,
    GaussianFilter,
    PercentileFilter,
    SiteFilter,
)


class FilterEntry(Strict):
    """What every filter's entry has: its ``type`` and the site filter it configures (``applies``,
    from the registry in :mod:`flare_airflow.core.privacy.filters`), whose parameters are its fields."""

    applies: ClassVar[type[SiteFilter]]
    type: str

    def site_filter(self) -> SiteFilter:
        return self.applies(**self.model_dump(exclude={"type"}))

    def noise(self) -> float | None:
        """The noise multiplier z of the noise the filter adds, or None when it adds none."""
        return self.site_filter().noise()


class ExcludeVars(FilterEntry):
    """Tensors that never leave the site: listed by name, or fully matching ``regex``."""

    applies = ExcludeVarsFilter
    type: Literal["exclude_vars"]
    names: list[str] = Field(default_factory=list, description="tensor names")
    regex: str | None = Field(None, description="a Python regular expression matched against whole names")

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"regex {value!r} is not a valid regular expression ({exc})") from None
        return value

    @model_validator(mode="after")
    def _something(self) -> ExcludeVars:
        if not self.names and self.regex is None:
            raise ValueError("exclude_vars needs names or a regex")
        return self


class Clip(FilterEntry):
    """Scale the update's difference so that its L2 norm over all float tensors is at most ``clip``."""

    applies = ClipFilter
    type: Literal["clip"]
    clip: float = Field(description="L2 norm bound C, > 0")

    @field_validator("clip", mode="before")
    @classmethod
    def _clip(cls, value: Any) -> float:
        return positive_number(value, "clip", "the L2 norm bound of the update, e.g. 1.0")


class Gaussian(FilterEntry):
    """Clip to ``clip``, then add N(0, (noise_multiplier x clip)²) to every float element (local DP)."""

    applies = GaussianFilter
    type: Literal["gaussian"]
    clip: float = Field(description="L2 norm bound C, > 0: the noise's sensitivity")
    noise_multiplier: float = Field(description="z: the noise's standard deviation is z x C")

    @field_validator("clip", mode="before")
    @classmethod
    def _clip(cls, value: Any) -> float:
        return positive_number(value, "clip", "the L2 norm bound of the update and the noise's sensitivity, e.g. 1.0")

    @field_validator("noise_multiplier", mode="before")
    @classmethod
    def _z(cls, value: Any) -> float:
        return positive_number(value, "noise_multiplier", "z, the noise's sd in units of clip, e.g. 1.0")


class Percentile(FilterEntry):
    """NVIDIA FLARE's PercentilePrivacy: NOT differential privacy (a heuristic; spends no ε)."""

    applies = PercentileFilter
    type: Literal["percentile"]
    percentile: float = Field(10.0, description="zero differences below this percentile of magnitudes (0-100)")
    gamma: float = Field(0.01, description="clip the remaining differences to [-gamma, gamma]")

    @field_validator("percentile", mode="before")
    @classmethod
    def _percentile(cls, value: Any) -> float:
        if not (is_real_number(value) and 0 <= value <= 100):
            raise ValueError(f"percentile must be a number from 0 to 100, got {value!r}")
        return float(value)

    @field_validator("gamma", mode="before")
    @classmethod
    def _gamma(cls, value: Any) -> float:
        return positive_number(value, "gamma", "the bound of each remaining difference, e.g. 0.01")


FilterSpec = Annotated[ExcludeVars | Clip | Gaussian | Percentile, Field(discriminator="type")]

# Every filter's entry by its type, read off the union (one place to add a filter's entry).
FILTER_SPECS: dict[str, type[FilterEntry]] = {
    typing.get_args(member.model_fields["type"].annotation)[0]: member
    for member in typing.get_args(typing.get_args(FilterSpec)[0])
}
FILTER_TYPES: tuple[str, ...] = tuple(FILTER_SPECS)
if TYPE_CHECKING:
    FilterType = str
else:  # the job file's allow_job_filters / skip_site_filters name the union's types, and no other
    FilterType = Literal[FILTER_TYPES]


def all_filter_types() -> list[FilterType]:
    return list(FILTER_TYPES)
