"""What starts a job's runs besides the form: the sites' data (``trigger: {on_data: ...}``).

A job with ``on_data`` runs when at least ``min_sites`` of its sites announced fresh data (see
:mod:`flare_airflow.core.data_ready`), on exactly those sites. Durations are written ``90s``,
``30m``, ``6h``, ``1d`` or ``2w``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from flare_airflow.core.config.describe import short_repr
from flare_airflow.core.config.validators import MAX_SECONDS, Strict

_DURATION = re.compile(r"^([1-9][0-9]{0,6})([smhdw])\Z")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def duration_seconds(value: Any, what: str) -> int:
    """Seconds of a duration written ``<n><unit>`` (unit s, m, h, d or w)."""
    match = _DURATION.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"{what} {short_repr(value)} is not a duration: write a whole number and a unit, "
            "e.g. 90s, 30m, 6h, 1d or 2w"
        )
    seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds > MAX_SECONDS:
        raise ValueError(f"{what} {short_repr(value)} is longer than a year; use at most 366d")
    return seconds


class OnData(Strict):
    """Run when enough sites announced fresh data (``flare-airflow site data-ready``)."""

    min_sites: int = Field(ge=1, description="sites with fresh data that start a run (at most the job's sites)")
    window: str = Field(
        "1d",
        description="an announcement is fresh for this long: older ones sit the run out (e.g. 1d, 6h)",
    )

    @model_validator(mode="before")
    @classmethod
    def _not_yet(cls, data: Any) -> Any:
        if isinstance(data, dict) and "wait" in data:
            raise ValueError(
                "trigger.on_data.wait is not supported yet: a run starts once min_sites sites are fresh; "
                "leave wait out (issue 39 tracks the wait with a smaller quorum)"
            )
        return data

    @field_validator("window")
    @classmethod
    def _window(cls, value: str) -> str:
        duration_seconds(value, "window")
        return value

    @property
    def window_seconds(self) -> int:
        return duration_seconds(self.window, "window")


class TriggerSpec(Strict):
    """What starts the job's runs besides a manual trigger."""

    on_data: OnData | None = Field(None, description="run when a quorum of sites announced fresh data")
