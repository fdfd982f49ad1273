"""Site policy of local-process sites (``launcher_spec.process``) and their Airflow secret references."""

from __future__ import annotations

import posixpath
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from flare_airflow.core.config.validators import (
    RESERVED_ENV_PREFIX,
    Strict,
    env_or_secret,
    env_values,
    exactly_one,
    no_nul,
    secret_env_names,
    secret_references,
)

# A process trainer inherits the worker's environment minus Airflow's own variables
# (flare_airflow.launchers.process): a job may not put them back.
RESERVED_PROCESS_ENV_PREFIXES = (RESERVED_ENV_PREFIX, "AIRFLOW", "_AIRFLOW")
CONNECTION_FIELDS = ("password", "login", "host", "schema", "port", "uri")


class AirflowSecretRef(Strict):
    """A secret of a process site: a field of an Airflow connection, or an Airflow variable.

    Resolved on the worker when the site job starts, masked in task logs, and passed to the
    trainer's environment only -- the value never appears in a job, argv, XCom or the store.
    (The process sites' counterpart of the Kubernetes ``SecretRef``.)
    """

    conn_id: str | None = Field(None, description="Airflow connection id")
    field: str = Field(
        "password", description="connection field: password, login, host, schema, port, uri or extra.<key>"
    )
    variable: str | None = Field(None, description="Airflow variable key (instead of conn_id)")

    @field_validator("conn_id", "variable")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or any(c.isspace() or c == "\0" for c in value)):
            raise ValueError(f"{value!r} must be a non-empty Airflow connection id or variable key without spaces")
        return value

    @field_validator("field")
    @classmethod
    def _field(cls, value: str) -> str:
        if value not in CONNECTION_FIELDS and not (value.startswith("extra.") and len(value) > len("extra.")):
            raise ValueError(f"field {value!r} is not one of {', '.join(CONNECTION_FIELDS)} or extra.<key>")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> AirflowSecretRef:
        exactly_one("a secret reference", conn_id=self.conn_id, variable=self.variable)
        if self.variable is not None and "field" in self.model_fields_set:
            raise ValueError("field applies to conn_id only (a variable has one value)")
        return self

    def describe(self) -> str:
        return f"Airflow variable {self.variable!r}" if self.variable else f"connection {self.conn_id!r} {self.field}"


def airflow_secret_references(value: Any) -> Any:
    """``secret_env`` of sites whose secrets come from Airflow (process and SLURM sites), as references."""
    return secret_references(
        value,
        AirflowSecretRef,
        "{conn_id: <connection>, field: <field>} or {variable: <key>}",
        "Airflow connections/variables",
    )


class AirflowEnvBlock(Strict):
    """The ``env`` / ``secret_env`` checks of the backends whose secrets are Airflow references
    resolved on the worker (process, SLURM, container sites); each block declares both fields and
    the variable prefixes its jobs may not set (``reserved_env_prefixes``)."""

    reserved_env_prefixes: ClassVar[tuple[str, ...]] = RESERVED_PROCESS_ENV_PREFIXES

    @field_validator("env", check_fields=False)
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return env_values(value, cls.reserved_env_prefixes)

    @field_validator("secret_env", mode="before", check_fields=False)
    @classmethod
    def _secret_references(cls, value: Any) -> Any:
        return airflow_secret_references(value)

    @field_validator("secret_env", check_fields=False)
    @classmethod
    def _secret_env(cls, value: dict[str, AirflowSecretRef]) -> dict[str, AirflowSecretRef]:
        return secret_env_names(value, cls.reserved_env_prefixes)


class ProcessLaunchSpec(AirflowEnvBlock):
    """Site policy for local-process site jobs."""

    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the trainer")
    secret_env: dict[str, AirflowSecretRef] = Field(
        default_factory=dict,
        description="environment from Airflow: NAME: {conn_id: <id>, field: password} or {variable: <key>}",
    )
    cwd: str | None = Field(None, description="working directory of the trainer")

    @model_validator(mode="after")
    def _env_or_secret(self) -> ProcessLaunchSpec:
        env_or_secret(self.env, self.secret_env)
        return self

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it out to run in the job file's directory)")
        return None if value is None else no_nul(value, "cwd")


# More than this many writable directories or devices is a policy no admin means.
_MAX_CONFINEMENT_PATHS = 64


class ProcessConfinement(Strict):
    """How a process site confines its trainers (site policy only: ``sites.<site>.confinement``).

    ``auto`` (the default): confined with bubblewrap where the worker can, else unconfined with a
    warning in the task log. ``required``: a worker that cannot confine fails the site task.
    ``off``: the trainer runs as the worker's user and can write wherever that user can.
    """

    mode: Literal["auto", "required", "off"] = Field(
        "auto", description="auto: confine where the host can; required: refuse to run unconfined; off: unconfined"
    )
    network: bool = Field(True, description="false: no network but the trainer's own loopback")
    writable: list[str] = Field(
        default_factory=list, description="directories the trainer may write besides its output directory and /tmp"
    )
    devices: list[str] = Field(default_factory=list, description="device nodes passed through besides the GPUs")

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        # YAML 1.1 (PyYAML) reads an unquoted `off` (and `no`, `false`) as the boolean false: the docs'
        # `mode: off` must mean mode 'off', not fail. An unquoted `on`/`yes`/`true` names no mode.
        if value is False:
            return "off"
        if value is True:
            raise ValueError(
                "must be 'auto', 'required' or 'off'; `on`/`yes`/`true` names no mode (YAML reads it as true)"
            )
        return value

    @field_validator("writable")
    @classmethod
    def _writable(cls, value: list[str]) -> list[str]:
        return [_confinement_path(p, "writable") for p in _bounded(value, "writable")]

    @field_validator("devices")
    @classmethod
    def _devices(cls, value: list[str]) -> list[str]:
        out = [_confinement_path(p, "devices") for p in _bounded(value, "devices")]
        for path in out:
            if not path.startswith("/dev/"):
                raise ValueError(f"devices entry {path!r} is not a device node under /dev/ (e.g. /dev/infiniband)")
        return out

    @model_validator(mode="after")
    def _off_is_off(self) -> ProcessConfinement:
        if self.mode == "off" and (not self.network or self.writable or self.devices):
            raise ValueError(
                "mode 'off' runs the trainer unconfined, so network, writable and devices would not apply; "
                "remove them, or use mode 'auto' or 'required'"
            )
        return self


def _bounded(value: list[str], what: str) -> list[str]:
    if len(value) > _MAX_CONFINEMENT_PATHS:
        raise ValueError(f"{what} lists {len(value)} paths; at most {_MAX_CONFINEMENT_PATHS}")
    return value


def _confinement_path(value: str, what: str) -> str:
    no_nul(value, what)
    if not posixpath.isabs(value):
        raise ValueError(f"{what} entry {value!r} must be an absolute path on the site's worker")
    norm = posixpath.normpath(value)
    if norm in ("/", "//"):
        raise ValueError(f"{what} entry {value!r} is the whole file system: that is mode 'off', say so")
    if ".." in value.split("/"):
        raise ValueError(f"{what} entry {value!r} must not contain '..'; give the directory itself")
    return norm
