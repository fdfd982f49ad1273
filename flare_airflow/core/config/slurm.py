"""Site policy of SLURM sites (``launcher_spec.slurm``): where and how a site job is submitted.

A site job becomes one batch job (``sbatch``) built by :mod:`flare_airflow.launchers.slurm`.
Resources come from the job's ``resource_spec`` (``num_of_gpus`` -> ``--gres=gpu:N`` per node,
``num_of_cpus`` -> ``--cpus-per-task``, ``memory`` -> ``--mem``); site policy from this block.
Secrets are Airflow references (``secret_env``), resolved on the worker that submits the job.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator

from flare_airflow.core.config.describe import short_repr
from flare_airflow.core.config.process import AirflowEnvBlock, AirflowSecretRef
from flare_airflow.core.config.validators import (
    RESERVED_ENV_PREFIX,
    argv,
    env_or_secret,
    no_nul,
    positive_seconds,
)

LOCAL_CONNECTION = "local"
SSH_PREFIX = "ssh:"
# Names SLURM gives partitions, accounts, QOS: no spaces, commas or shell characters.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}\Z")
_CONN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,250}\Z")
# sbatch's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(\d+)\Z|^(\d+):(\d{1,2})\Z|^(\d+):(\d{1,2}):(\d{1,2})\Z|^(\d+)-(\d{1,2})(:\d{1,2}(:\d{1,2})?)?\Z")
# SLURM's own variables (SLURM_*) belong to the job; RANK & co. are set per node (nodes > 1).
RESERVED_SLURM_ENV_PREFIXES = (RESERVED_ENV_PREFIX, "SLURM_", "AIRFLOW", "_AIRFLOW")
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")

# Extra sbatch options a site may add; each either a flag or --name=value. Everything flare-airflow
# sets itself (job name, output, partition, resources, environment, working directory, ...) is
# refused: it would change what the job is or where its output goes behind the launcher's back.
SBATCH_FLAGS = frozenset({"--exclusive", "--requeue", "--no-requeue", "--spread-job", "--contiguous", "--overcommit"})
SBATCH_VALUE_OPTIONS = frozenset(
    {
        "--constraint",
        "--prefer",
        "--reservation",
        "--nice",
        "--exclude",
        "--nodelist",
        "--licenses",
        "--gres-flags",
        "--hint",
        "--mem-per-gpu",
        "--cpus-per-gpu",
        "--switches",
        "--wckey",
        "--distribution",
        "--core-spec",
        "--threads-per-core",
        "--cores-per-socket",
        "--sockets-per-node",
        "--tmp",
        "--mincpus",
        "--mcs-label",
        "--comment",
        "--signal",
        "--clusters",
    }
)

# sbatch options that have a field of their own.
_OWN_FIELDS = {
    "--partition": "launcher_spec.slurm.partition",
    "-p": "launcher_spec.slurm.partition",
    "--account": "launcher_spec.slurm.account",
    "-A": "launcher_spec.slurm.account",
    "--qos": "launcher_spec.slurm.qos",
    "-q": "launcher_spec.slurm.qos",
    "--time": "launcher_spec.slurm.time_limit",
    "-t": "launcher_spec.slurm.time_limit",
    "--nodes": "launcher_spec.slurm.nodes",
    "-N": "launcher_spec.slurm.nodes",
    "--ntasks-per-node": "launcher_spec.slurm.tasks_per_node",
    "--ntasks": "launcher_spec.slurm.nodes and tasks_per_node",
    "-n": "launcher_spec.slurm.nodes and tasks_per_node",
    "--gres": "resource_spec.num_of_gpus",
    "--gpus": "resource_spec.num_of_gpus",
    "-G": "resource_spec.num_of_gpus",
    "--gpus-per-node": "resource_spec.num_of_gpus",
    "--cpus-per-task": "resource_spec.num_of_cpus",
    "-c": "resource_spec.num_of_cpus",
    "--mem": "resource_spec.memory",
    "--mem-per-cpu": "resource_spec.memory",
}


def sbatch_option(item: str) -> str:
    """One extra sbatch option, checked against the allow list."""
    no_nul(item, "sbatch option")
    if "\n" in item or "\r" in item:
        raise ValueError(f"sbatch option {short_repr(item)} contains a line break")
    name, eq, value = item.partition("=")
    if name in SBATCH_FLAGS and not eq:
        return item
    if name in SBATCH_VALUE_OPTIONS and eq and value.strip():
        return item
    if name in SBATCH_VALUE_OPTIONS:
        raise ValueError(f"sbatch option {short_repr(item)} needs a value: write it as {name}=<value>")
    if name in SBATCH_FLAGS:
        raise ValueError(f"sbatch option {name} takes no value (got {short_repr(item)})")
    field = _OWN_FIELDS.get(name)
    if field:
        why = f"use {field} instead"
    elif not name.startswith("--"):
        why = "write options in their long form, one item each (--name=value)"
    else:
        why = "flare-airflow sets the job name, output, environment and working directory itself"
    raise ValueError(
        f"sbatch option {short_repr(item)} is not allowed: {why}; the allowed extra options are listed in "
        "docs/site-admins.md (SLURM sites)"
    )


class SlurmLaunchSpec(AirflowEnvBlock):
    """Site policy for SLURM site jobs (``launcher_spec.slurm``): one batch job per site job and round."""

    reserved_env_prefixes: ClassVar[tuple[str, ...]] = RESERVED_SLURM_ENV_PREFIXES

    connection: str = Field(
        LOCAL_CONNECTION,
        description="'local' (the Airflow worker is a submit host) or 'ssh:<Airflow SSH connection id>'",
    )
    partition: str | None = Field(None, description="sbatch --partition (default: the cluster's default)")
    account: str | None = Field(None, description="sbatch --account")
    qos: str | None = Field(None, description="sbatch --qos")
    time_limit: str | None = Field(
        None, description="sbatch --time: minutes, HH:MM:SS or D-HH:MM:SS (default: the partition's)"
    )
    nodes: int = Field(1, ge=1, le=1024, description="nodes per site job; > 1: the trainer runs once per task")
    tasks_per_node: int = Field(1, ge=1, le=256, description="trainer processes per node (ranks)")
    extra_sbatch_options: list[str] = Field(default_factory=list, description="allowed extra sbatch options")
    env: dict[str, str] = Field(default_factory=dict, description="plain environment values (never secrets)")
    secret_env: dict[str, AirflowSecretRef] = Field(
        default_factory=dict,
        description="environment from Airflow: NAME: {conn_id: <id>, field: password} or {variable: <key>}",
    )
    cwd: str | None = Field(None, description="the job's working directory on the cluster")
    output_dir: str = Field(
        "flare-airflow-slurm",
        description="where job output files are written (shared with the submit host); relative: to the home "
        "directory of the submitting user",
    )
    trainer_command: list[str] | None = Field(
        None, description="the trainer's command on the cluster; default: the job's trainer.command (this Python)"
    )
    trainer_script: str | None = Field(
        None, description="the trainer script's path on the cluster; default: trainer.script resolved here"
    )
    master_port: int | None = Field(
        None, ge=1024, le=65535, description="rendezvous port for nodes > 1 (default: derived from the job id)"
    )
    pending_timeout: float = Field(300.0, gt=0, description="seconds PENDING for Resources / Priority")
    startup_timeout: float = Field(120.0, gt=0, description="seconds PENDING for a reason no wait fixes")
    poll_interval: float = Field(2.0, gt=0, description="seconds between job state reads")

    @field_validator("connection")
    @classmethod
    def _connection(cls, value: str) -> str:
        if value == LOCAL_CONNECTION:
            return value
        conn_id = value.removeprefix(SSH_PREFIX)
        if not value.startswith(SSH_PREFIX) or not _CONN_ID.match(conn_id):
            raise ValueError(
                f"connection {short_repr(value)} must be 'local' (this worker submits with sbatch) or "
                "'ssh:<conn id>' naming an Airflow SSH connection to the cluster's login node, e.g. ssh:hpc_login"
            )
        return value

    @property
    def ssh_conn_id(self) -> str | None:
        return None if self.connection == LOCAL_CONNECTION else self.connection.removeprefix(SSH_PREFIX)

    @field_validator("partition", "account", "qos")
    @classmethod
    def _slurm_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not _SLURM_NAME.match(value):
            raise ValueError(
                f"{info.field_name} {short_repr(value)} is not a SLURM name: letters, digits, '_', '.', '+', '-' "
                "(no spaces or commas), at most 128 characters"
            )
        return value

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time_limit(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # YAML `time_limit: 30` is 30 minutes, as sbatch reads it
        if isinstance(value, str) and (not _TIME.match(value) or value.strip("0:-") == ""):
            raise ValueError(
                f"time_limit {short_repr(value)} is not a SLURM time: minutes (30), MM:SS, HH:MM:SS (02:00:00), "
                "D-HH, D-HH:MM or D-HH:MM:SS (1-12:00:00), more than zero"
            )
        return value

    @field_validator("extra_sbatch_options")
    @classmethod
    def _extra(cls, value: list[str]) -> list[str]:
        return [sbatch_option(item) for item in value]

    @field_validator("cwd", "output_dir", "trainer_script")
    @classmethod
    def _path(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and (not value.strip() or "\n" in value):
            raise ValueError(f"{info.field_name} must be a path without line breaks (leave it out for the default)")
        return None if value is None else no_nul(value, str(info.field_name))

    @field_validator("trainer_command", mode="before")
    @classmethod
    def _command(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty (leave it out for the job's trainer.command)")
        return argv(value)

    @field_validator("pending_timeout", "startup_timeout", "poll_interval", mode="before")
    @classmethod
    def _seconds(cls, value: Any, info: ValidationInfo) -> Any:
        return positive_seconds(value, str(info.field_name))

    @model_validator(mode="after")
    def _consistent(self) -> SlurmLaunchSpec:
        env_or_secret(self.env, self.secret_env)
        for name in (*self.env, *self.secret_env):
            if name in DISTRIBUTED_ENV:
                raise ValueError(
                    f"{name} is set by flare-airflow for each rank of a site job (RANK, WORLD_SIZE, LOCAL_RANK, "
                    "MASTER_ADDR, MASTER_PORT); choose another name"
                )
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node
