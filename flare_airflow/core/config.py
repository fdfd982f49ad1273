"""Job configuration: one validated model for YAML and Python jobs.

A job names its trainer, its rounds, its quorum and its sites. Sites follow NVIDIA FLARE's job
meta: a ``@default`` site entry, ``resource_spec`` (``num_of_gpus``, ``num_of_cpus``, ``memory``)
and ``launcher_spec`` blocks per backend. Blocks merge shallowly, most specific last::

    top-level launcher_spec.default  <  sites.@default  <  top-level launcher_spec.<site>  <  sites.<site>

Every error names the file, the field and the site, and says what is allowed.
"""

from __future__ import annotations

import pathlib
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flare_airflow.core.errors import ConfigError

DEFAULT_SITE = "@default"
NVFLARE_DEFAULT = "default"
BACKENDS = ("process", "k8s", "docker", "slurm")
BACKEND_ALIASES = {"kubernetes": "k8s"}
SUPPORTED_BACKENDS = ("process",)

_SITE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_JOB_NAME = re.compile(r"^[a-z0-9]([-a-z0-9_]*[a-z0-9])?$")
Scalar = int | float | str | bool


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResourceSpec(_Strict):
    """What one site job asks for (NVFlare ``resource_spec``)."""

    num_of_gpus: int = Field(0, ge=0, description="GPUs per site job")
    num_of_cpus: float | None = Field(None, gt=0, description="CPU cores per site job")
    memory: str | None = Field(None, description="memory per site job, e.g. '4Gi'")
    mem_per_gpu_in_GiB: float | None = Field(None, ge=0, description="free GPU memory needed per GPU")

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> Any:
        if value is None:
            return None
        text = str(value)
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)?([EPTGMK]i?|[eE][0-9]+)?", text):
            raise ValueError(f"{text!r} is not a quantity like '512Mi', '4Gi' or '2G'")
        return text


class ProcessLaunchSpec(_Strict):
    """Site policy for local-process site jobs."""

    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the trainer")
    cwd: str | None = Field(None, description="working directory of the trainer")


class LauncherSpec(_Strict):
    """Per-backend launcher blocks. Only the block of the site's backend is used."""

    process: ProcessLaunchSpec = Field(default_factory=ProcessLaunchSpec)
    k8s: dict[str, Any] = Field(default_factory=dict)
    docker: dict[str, Any] = Field(default_factory=dict)
    slurm: dict[str, Any] = Field(default_factory=dict)


class ResourceManagerSpec(_Strict):
    """How a site's GPUs are managed (NVFlare's resource managers).

    ``gpu``: the site has ``num_of_gpus`` GPUs; an Airflow pool with that many slots bounds its
    concurrent jobs, and each job gets its own devices. ``passthrough``: no pool; the backend
    (Kubernetes, SLURM) enforces the limits itself.
    """

    type: Literal["gpu", "passthrough"] = "gpu"
    num_of_gpus: int = Field(0, ge=0, description="GPUs the site has (pool slots)")
    gpu_class: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,30}$", description="e.g. 'a100'")
    pool: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,256}$", description="Airflow pool name")
    ignore_host: bool = Field(False, description="do not assign local devices (jobs run on other machines)")


class SiteSpec(_Strict):
    """One site of a job, after ``@default`` has been merged in."""

    launcher: Literal["process", "k8s", "docker", "slurm"] = "process"
    weight: float = Field(1.0, gt=0, description="multiplies num_samples in FedAvg")
    retries: int = Field(0, ge=0, le=20)
    retry_delay_seconds: float = Field(10.0, ge=0)
    resource_spec: ResourceSpec = Field(default_factory=ResourceSpec)
    resource_manager: ResourceManagerSpec | None = None
    launcher_spec: LauncherSpec = Field(default_factory=LauncherSpec)

    @field_validator("launcher", mode="before")
    @classmethod
    def _alias(cls, value: Any) -> Any:
        return BACKEND_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("launcher")
    @classmethod
    def _supported(cls, value: str) -> str:
        if value not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"launcher {value!r} is not available in this version of flare-airflow; "
                f"supported: {', '.join(SUPPORTED_BACKENDS)}"
            )
        return value

    @model_validator(mode="after")
    def _gpus_fit(self) -> SiteSpec:
        wanted = self.resource_spec.num_of_gpus
        manager = self.resource_manager
        if wanted and manager is None:
            raise ValueError(
                f"a site job asks for {wanted} GPU(s) (resource_spec.num_of_gpus) but the site declares no "
                "resource_manager: add resource_manager: {type: gpu, num_of_gpus: <the site's GPUs>}, "
                "or {type: passthrough} if the backend enforces GPU limits itself"
            )
        if manager is not None and manager.type == "gpu":
            if manager.num_of_gpus < 1:
                raise ValueError("resource_manager.num_of_gpus must be >= 1 for type 'gpu' (the site's GPUs)")
            if wanted > manager.num_of_gpus:
                raise ValueError(
                    f"a site job asks for {wanted} GPUs but the site has only {manager.num_of_gpus} "
                    "(resource_manager.num_of_gpus): it could never run -- Airflow would wait for pool "
                    "slots forever. Lower resource_spec.num_of_gpus or raise the site's capacity."
                )
        return self

    def pool_name(self, site: str) -> str | None:
        """The Airflow pool bounding this site's GPU jobs, or ``None`` (no GPUs asked, passthrough)."""
        manager = self.resource_manager
        if manager is None or manager.type != "gpu" or not self.resource_spec.num_of_gpus:
            return None
        if manager.pool:
            return manager.pool
        return f"flare_gpu_{site}" + (f"_{manager.gpu_class}" if manager.gpu_class else "")


class TrainerSpec(_Strict):
    """The trainer: a script run as an exact argv ``command + [script] + args`` (never a shell)."""

    script: str = Field(description="trainer script, relative to the job file")
    args: list[str] = Field(default_factory=list, description="arguments, passed literally")
    command: list[str] = Field(default_factory=list, description="command prefix; default: this Python")
    hparams: dict[str, Scalar] = Field(default_factory=dict, description="hyper-parameters (UI form fields)")
    launch_timeout: float | None = Field(
        None, gt=0, description="seconds for the trainer to call receive(); unlimited by default"
    )
    shutdown_timeout: float = Field(10.0, ge=0, description="grace between SIGTERM and SIGKILL")
    timeout: float | None = Field(None, gt=0, description="seconds a site job may run (execution timeout)")

    @field_validator("args", "command", mode="before")
    @classmethod
    def _argv(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError("must be a list of arguments, not a string (arguments are never run through a shell)")
        if isinstance(value, list):
            out = []
            for item in value:
                if isinstance(item, bool) or not isinstance(item, str | int | float):
                    raise ValueError(f"argument {item!r} must be a string or a number")
                out.append(str(item))
            return out
        return value


class AggregatorSpec(_Strict):
    name: Literal["fedavg"] = "fedavg"


class JobConfig(_Strict):
    """A federated job. Build it with :func:`load_job` (YAML) or :func:`job_from_dict` (Python)."""

    job: str = Field(description="job name: lowercase letters, digits, '-' and '_'")
    rounds: int = Field(ge=1, le=1000, description="maximum number of rounds (the UI form may ask for fewer)")
    min_clients: int = Field(ge=1, description="valid updates needed for a round to count")
    trainer: TrainerSpec
    initial_model: str = Field(description="safetensors file with the initial global model")
    store: str | None = Field(None, description="model store URI; default <AIRFLOW_HOME>/flare_store")
    aggregator: AggregatorSpec = Field(default_factory=AggregatorSpec)
    evaluate: bool = Field(True, description="evaluate each new global model with the trainer (task 'evaluate')")
    schedule: str | None = Field(None, description="Airflow schedule for recurring runs")
    warm_start: bool = Field(False, description="default of the run form's warm-start switch")
    check_pools: bool = Field(True, description="check the sites' GPU pools when a run starts")
    sites: dict[str, SiteSpec]
    base_dir: str = Field(".", description="directory relative paths are resolved against")

    @model_validator(mode="before")
    @classmethod
    def _merge_sites(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        data["sites"] = merge_sites(data.get("sites"), data.pop("resource_spec", None), data.pop("launcher_spec", None))
        return data

    @field_validator("job")
    @classmethod
    def _job_name(cls, value: str) -> str:
        if not _JOB_NAME.match(value) or len(value) > 50:
            raise ValueError(
                f"job name {value!r} is not allowed: use lowercase letters, digits, '-' and '_', "
                "start and end with a letter or digit, at most 50 characters"
            )
        return value

    @field_validator("sites")
    @classmethod
    def _site_names(cls, sites: dict[str, SiteSpec]) -> dict[str, SiteSpec]:
        if not sites:
            raise ValueError("a job needs at least one site")
        for name in sites:
            if not _SITE_NAME.match(name) or len(name) > 63:
                raise ValueError(
                    f"site name {name!r} cannot be a pod name: use lowercase letters, digits and '-', "
                    "start and end with a letter or digit, at most 63 characters (RFC 1123)"
                )
        return sites

    @model_validator(mode="after")
    def _cross_checks(self) -> JobConfig:
        if self.min_clients > len(self.sites):
            raise ValueError(
                f"min_clients is {self.min_clients} but the job has only {len(self.sites)} site(s) "
                f"({', '.join(self.sites)}); lower min_clients or add sites"
            )
        if any(s.launcher == "process" for s in self.sites.values()) and not self.script_path().is_file():
            raise ValueError(
                f"trainer.script {self.trainer.script!r} does not exist (looked at {self.script_path()}); "
                "paths are relative to the job file"
            )
        if not self.initial_model_path().is_file():
            raise ValueError(
                f"initial_model {self.initial_model!r} does not exist (looked at {self.initial_model_path()})"
            )
        return self

    def resolve(self, relative: str) -> pathlib.Path:
        path = pathlib.Path(relative).expanduser()
        return path if path.is_absolute() else (pathlib.Path(self.base_dir) / path).resolve()

    def script_path(self) -> pathlib.Path:
        return self.resolve(self.trainer.script)

    def initial_model_path(self) -> pathlib.Path:
        return self.resolve(self.initial_model)

    def site_weights(self) -> dict[str, float]:
        return {name: site.weight for name, site in self.sites.items()}


def _merge_block(*blocks: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for block in blocks:
        if block:
            if not isinstance(block, Mapping):
                raise ValueError(f"expected a mapping, got {type(block).__name__}: {block!r}")
            out.update(block)
    return out


def _backends(block: Any, where: str) -> dict[str, Any]:
    if not block:
        return {}
    if not isinstance(block, Mapping):
        raise ValueError(f"{where} must be a mapping of backend -> settings, got {block!r}")
    out = {}
    for key, value in block.items():
        backend = BACKEND_ALIASES.get(key, key)
        if backend not in BACKENDS:
            raise ValueError(f"{where}: unknown launcher backend {key!r}; allowed: {', '.join(BACKENDS)}, kubernetes")
        out[backend] = value
    return out


def merge_sites(sites: Any, top_resources: Any, top_launchers: Any) -> Any:
    """Fold ``@default`` and NVFlare's top-level ``resource_spec`` / ``launcher_spec`` into each site."""
    if sites is None:
        return sites
    if isinstance(sites, list):
        sites = {str(name): {} for name in sites}
    if not isinstance(sites, Mapping):
        return sites
    top_resources = dict(top_resources or {})
    top_launchers = dict(top_launchers or {})
    default = dict(sites.get(DEFAULT_SITE) or {})
    names = [n for n in sites if n != DEFAULT_SITE]
    for key, what in ((top_resources, "resource_spec"), (top_launchers, "launcher_spec")):
        for name in key:
            if name not in (DEFAULT_SITE, NVFLARE_DEFAULT) and name not in names:
                raise ValueError(f"{what} names site {name!r}, which is not in sites ({', '.join(names)})")
    merged: dict[str, Any] = {}
    for name in names:
        own = sites[name] or {}
        if not isinstance(own, Mapping):
            merged[name] = own
            continue
        site = {**default, **own}
        site["resource_spec"] = _merge_block(
            top_resources.get(DEFAULT_SITE),
            top_resources.get(NVFLARE_DEFAULT),
            default.get("resource_spec"),
            top_resources.get(name),
            own.get("resource_spec"),
        )
        layers = [
            _backends(top_launchers.get(NVFLARE_DEFAULT), "launcher_spec.default"),
            _backends(default.get("launcher_spec"), "sites.@default.launcher_spec"),
            _backends(top_launchers.get(name), f"launcher_spec.{name}"),
            _backends(own.get("launcher_spec"), f"sites.{name}.launcher_spec"),
        ]
        site["launcher_spec"] = {
            backend: _merge_block(*(layer.get(backend) for layer in layers))
            for backend in BACKENDS
            if any(backend in layer for layer in layers)
        }
        merged[name] = site
    return merged


def _allowed_keys(loc: tuple[Any, ...]) -> list[str] | None:
    """Walk the model types along ``loc`` to list the keys allowed where an unknown key appeared."""
    current: Any = JobConfig
    i = 0
    while i < len(loc):
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(loc[i]))
            if field is None:
                return None
            current = field.annotation
            i += 1
            continue
        origin = typing.get_origin(current)
        args = typing.get_args(current)
        if origin in (typing.Union, types.UnionType):
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            if not models:
                return None
            current = models[0]
        elif origin is dict:
            current = args[1]
            i += 1
        else:
            return None
    if current is JobConfig:
        # NVFlare's top-level blocks are folded into the sites before validation, so they are no fields.
        return [*JobConfig.model_fields, "resource_spec", "launcher_spec"]
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return None


def _describe(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        field = ".".join(str(p) for p in loc) or "(top level)"
        where = f"{source}: {field}"
        if len(loc) >= 2 and loc[0] == "sites":
            where += f" (site {loc[1]!r})"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            msg = f"unknown key {loc[-1]!r}" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
        elif err["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"{where}: {msg}")
    return "invalid job configuration:\n  " + "\n  ".join(lines)


def job_from_dict(data: Mapping[str, Any], *, source: str = "<python>", base_dir: str | None = None) -> JobConfig:
    """Validate a job given as a Python mapping (the same shape as the YAML file)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a job must be a mapping of keys to values, got {type(data).__name__}")
    payload = dict(data)
    if base_dir is not None:
        payload.setdefault("base_dir", base_dir)
    try:
        return JobConfig.model_validate(payload)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
    except ValueError as exc:  # raised while merging sites, before field validation
        raise ConfigError(f"invalid job configuration:\n  {source}: sites: {exc}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys instead of silently keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (each key may appear once)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_job(path: str | pathlib.Path) -> JobConfig:
    """Load and validate a job YAML file; relative paths in it are relative to the file."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the job file ({exc.strerror})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: malformed YAML: {problem}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the job file must be a YAML mapping (key: value), got {type(data).__name__}")
    return job_from_dict(data, source=str(path), base_dir=str(path.parent.resolve()))
