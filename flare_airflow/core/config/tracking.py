"""Experiment tracking of a job's runs (``tracking:``): which tracker, and how the run's tasks reach it.

Only the run's own tasks (prepare, each round's aggregation, publish) write to the tracker; sites
never do, so the job names no credentials. A tracking server is reached through an Airflow
connection (``conn_id``) whose URI and credentials come from Airflow's secrets backend; ``uri`` is
for trackers that need none (a SQLite file, a server on a private network), and one with
credentials in it is refused.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

from pydantic import Field, field_validator, model_validator

from flare_airflow.core.config.validators import Strict, conn_id_name, no_nul

TRACKING_BACKENDS = ("mlflow",)
# MLflow's own rule for experiment names is loose; ours keeps them printable and short.
_EXPERIMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._/:-]{0,249}$")
_URI_SCHEMES = ("http", "https", "sqlite", "file", "postgresql", "mysql")
# Query keys that carry a secret in the URIs of the trackers and databases above.
_SECRET_QUERY_KEYS = ("token", "access_token", "password", "passwd", "secret", "api_key", "apikey", "key", "sig")


def uri_credentials(uri: str) -> str | None:
    """What in ``uri`` is a credential (user info, a secret query parameter), else None."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        return "a user name or password before '@'"
    for key, _ in parse_qsl(parts.query, keep_blank_values=True):
        if key.lower() in _SECRET_QUERY_KEYS:
            return f"the query parameter {key!r}"
    return None


class TrackingSpec(Strict):
    """``tracking:`` of a job: ``{backend: mlflow}`` gives the embedded store (a SQLite file next to
    the model store); ``conn_id`` names the Airflow connection of a tracking server."""

    backend: Literal["mlflow"] = Field(description="the experiment tracker: mlflow")
    experiment: str | None = Field(None, description="experiment name; default: the job's name")
    conn_id: str | None = Field(
        None, description="Airflow connection of a tracking server (its URI and credentials stay in Airflow)"
    )
    uri: str | None = Field(None, description="tracking URI without credentials; default: sqlite:///<store>/mlflow.db")

    @field_validator("backend", mode="before")
    @classmethod
    def _backend(cls, value: object) -> object:
        if value not in TRACKING_BACKENDS:
            # Not echoed whole: the message names the allowed values instead.
            raise ValueError(
                f"unknown tracking backend {str(value)[:40]!r}: use one of {', '.join(TRACKING_BACKENDS)} "
                "(or leave tracking out)"
            )
        return value

    @field_validator("experiment")
    @classmethod
    def _experiment(cls, value: str | None) -> str | None:
        if value is not None and not _EXPERIMENT.match(value):
            raise ValueError(
                "tracking.experiment must start with a letter or digit and hold only letters, digits, "
                "spaces and . _ / : - (at most 250 characters)"
            )
        return value

    @field_validator("conn_id")
    @classmethod
    def _conn_id(cls, value: str | None) -> str | None:
        return None if value is None else conn_id_name(value, "tracking.conn_id")

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        if value is None:
            return None
        no_nul(value, "tracking.uri")
        scheme = value.partition("://")[0] if "://" in value else ""
        if scheme.split("+")[0] not in _URI_SCHEMES:
            raise ValueError(
                f"tracking.uri must be a tracking URI ({', '.join(s + '://' for s in _URI_SCHEMES)}); "
                "for a server with credentials use tracking.conn_id"
            )
        found = uri_credentials(value)
        if found is not None:
            # The URI is not echoed: it holds a secret, and this message goes to logs and the UI.
            raise ValueError(
                f"tracking.uri holds credentials ({found}); a job file must not: put the server's URI and "
                "credentials in an Airflow connection (secrets backend) and name it in tracking.conn_id"
            )
        return value

    @model_validator(mode="after")
    def _one_place(self) -> TrackingSpec:
        if self.conn_id is not None and self.uri is not None:
            raise ValueError("tracking: give conn_id (a server through an Airflow connection) or uri, not both")
        return self
