"""Experiment tracking of a job's runs (``tracking:``): which tracker, and how the run's tasks reach it.

Only the run's own tasks (prepare, each round's aggregation, publish) write to the tracker; sites
never do, so the job names no credentials. A tracking server is reached through an Airflow
connection (``conn_id``) whose URI and credentials come from Airflow's secrets backend; ``uri`` is
for trackers that need none (a SQLite file, a server on a private network), and one with
credentials in it is refused. Which ``uri`` a job may name is the deployment's choice, checked
where Airflow's configuration is read (``flare_airflow.operators.tracking``).

A deployment may track every job that does not say otherwise (``[flare_airflow] tracking`` in
Airflow's configuration, :func:`deployment_tracking`); a job opts out with ``tracking: false``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

from pydantic import Field, field_validator, model_validator

from flare_airflow.core.config.validators import Strict, conn_id_name, no_nul
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.redact import secret_query_key

TRACKING_BACKENDS = ("mlflow", "tensorboard")
Backend = Literal["mlflow", "tensorboard"]
# The deployment default's home in Airflow's configuration (and its AIRFLOW__... variable).
DEPLOYMENT_OPTION = "[flare_airflow] tracking (AIRFLOW__FLARE_AIRFLOW__TRACKING)"
# MLflow's registered model names: printable, no path separators (MLflow refuses '/' in them).
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._:-]{0,249}")
# MLflow's own rule for experiment names is loose; ours keeps them printable and short.
_EXPERIMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._/:-]{0,249}")
_URI_SCHEMES = ("http", "https", "sqlite", "file", "postgresql", "mysql")


def uri_credentials(uri: str) -> str | None:
    """What in ``uri`` is a credential (user info, a secret query parameter), else None."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        return "a user name or password before '@'"
    for key, _ in parse_qsl(parts.query, keep_blank_values=True):
        if secret_query_key(key):
            return f"the query parameter {key!r}"
    return None


class TrackingSpec(Strict):
    """``tracking:`` of a job: ``{backend: mlflow}`` gives the embedded store (a SQLite file next to
    the model store); ``conn_id`` names the Airflow connection of a tracking server;
    ``backend: tensorboard`` writes TensorBoard event files next to the model store, and a list
    (``[mlflow, tensorboard]``) writes both."""

    backend: tuple[Backend, ...] = Field(description="the experiment trackers: mlflow, tensorboard, or a list of them")
    experiment: str | None = Field(None, description="experiment name; default: the job's name")
    conn_id: str | None = Field(
        None, description="Airflow connection of a tracking server (its URI and credentials stay in Airflow)"
    )
    uri: str | None = Field(
        None,
        description="tracking URI without credentials, one the deployment lists ([flare_airflow] tracking_uris); "
        "default: sqlite:///<store>/mlflow.db",
    )
    register_model: str | None = Field(
        None, description="MLflow: register each run's published model as a version of this registered model"
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _backend(cls, value: object) -> object:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list | tuple) or not values:
            raise ValueError(
                f"tracking.backend must be one of {', '.join(TRACKING_BACKENDS)} or a list of them "
                "(or leave tracking out)"
            )
        for one in values:
            if one not in TRACKING_BACKENDS:
                # Not echoed whole: the message names the allowed values instead.
                raise ValueError(
                    f"unknown tracking backend {str(one)[:40]!r}: use one of {', '.join(TRACKING_BACKENDS)} "
                    "(or leave tracking out)"
                )
        if len(set(values)) != len(values):
            raise ValueError("tracking.backend names a tracker twice")
        return tuple(values)

    @property
    def mlflow(self) -> bool:
        return "mlflow" in self.backend

    @property
    def tensorboard(self) -> bool:
        return "tensorboard" in self.backend

    @field_validator("register_model")
    @classmethod
    def _register_model(cls, value: str | None) -> str | None:
        if value is not None and not _MODEL_NAME.fullmatch(value):
            raise ValueError(
                "tracking.register_model must start with a letter or digit and hold only letters, digits, "
                "spaces and . _ : - (at most 250 characters)"
            )
        return value

    @field_validator("experiment")
    @classmethod
    def _experiment(cls, value: str | None) -> str | None:
        if value is not None and not _EXPERIMENT.fullmatch(value):
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
        if not self.mlflow and (self.conn_id, self.uri, self.experiment, self.register_model) != (None,) * 4:
            raise ValueError(
                "tracking: conn_id, uri, experiment and register_model are MLflow's; add mlflow to tracking.backend "
                "or remove them"
            )
        return self


def deployment_tracking(setting: str) -> TrackingSpec | None:
    """The deployment's default ``tracking:`` from its setting: a backend (``mlflow``), a list
    (``mlflow,tensorboard``) or the whole block as JSON (``{"backend": "mlflow", "conn_id": "mlflow_team"}``);
    empty: no default."""
    text = setting.strip()
    if not text:
        return None
    data: Any
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f'{DEPLOYMENT_OPTION}: not valid JSON ({exc}); e.g. {{"backend": "mlflow"}}') from None
    else:
        names = [name.strip() for name in text.split(",")]
        data = {"backend": names[0] if len(names) == 1 else names}
    try:
        return TrackingSpec.model_validate(data)
    except ValueError as exc:  # pydantic's ValidationError is one
        errors = getattr(exc, "errors", None)
        why = (
            "; ".join(str(e.get("msg", e)).removeprefix("Value error, ") for e in errors())
            if callable(errors)
            else str(exc)
        )
        raise ConfigError(
            f"{DEPLOYMENT_OPTION}: {why}; fix the setting in airflow.cfg or the environment of Airflow's components"
        ) from None
