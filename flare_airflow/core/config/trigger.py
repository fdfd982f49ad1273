"""What starts a job's runs besides the form: the sites' data (``trigger: {on_data: ...}``).

A job with ``on_data`` runs when at least ``min_sites`` of its sites announced fresh data (see
:mod:`flare_airflow.core.data_ready`), on exactly those sites; with ``wait`` or a ``schedule``
also over fewer fresh sites, at least the job's quorum
(:func:`~flare_airflow.core.data_ready.decide_run`). Durations are written ``90s``,
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
    wait: str | None = Field(
        None,
        description="after this long since the first fresh announcement, run over the fresh sites if they are at "
        "least the job's quorum (min_clients), e.g. 6h",
    )

    @field_validator("window")
    @classmethod
    def _window(cls, value: str) -> str:
        duration_seconds(value, "window")
        return value

    @field_validator("wait")
    @classmethod
    def _wait(cls, value: str | None) -> str | None:
        if value is not None:
            duration_seconds(value, "wait")
        return value

    @model_validator(mode="after")
    def _wait_within_window(self) -> OnData:
        if self.wait_seconds is not None and self.wait_seconds >= self.window_seconds:
            raise ValueError(
                f"trigger.on_data.wait {self.wait} is not shorter than the window {self.window}: when the wait "
                "expired the first announcement would no longer be fresh; shorten wait or widen window"
            )
        return self

    @property
    def window_seconds(self) -> int:
        return duration_seconds(self.window, "window")

    @property
    def wait_seconds(self) -> int | None:
        return None if self.wait is None else duration_seconds(self.wait, "wait")


class TriggerSpec(Strict):
    """What starts the job's runs besides a manual trigger."""

    on_data: OnData | None = Field(None, description="run when a quorum of sites announced fresh data")
