"""Sites: each site's spec, and the merge of ``@default`` and NVFlare's top-level blocks into it.

Blocks merge shallowly, most specific last::

    top-level launcher_spec.default  <  sites.@default  <  top-level launcher_spec.<site>  <  sites.<site>
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from flare_airflow.core.backends import ALIASES, BACKENDS, BackendName, backend, canonical
from flare_airflow.core.config.container import ContainerLaunchSpec
from flare_airflow.core.config.describe import clip, short_repr
from flare_airflow.core.config.kubernetes import KubernetesLaunchSpec
from flare_airflow.core.config.privacy import SitePrivacy
from flare_airflow.core.config.process import ProcessConfinement, ProcessLaunchSpec
from flare_airflow.core.config.resources import ResourceManagerSpec, ResourceSpec
from flare_airflow.core.config.slurm import SlurmLaunchSpec
from flare_airflow.core.config.validators import (
    MAX_SECONDS,
    MAX_WEIGHT,
    MIN_WEIGHT,
    SITE_POLICY_CONTEXT,
    Strict,
    airflow_executor,
    queue_name,
)

if TYPE_CHECKING:
    from flare_airflow.core.backends import Backend

DEFAULT_SITE = "@default"
NVFLARE_DEFAULT = "default"
# The backends this version runs: the registry's (flare_airflow.core.backends).
SUPPORTED_BACKENDS = tuple(BACKENDS)


class LauncherSpec(Strict):
    """Per-backend launcher blocks. Only the block of the site's backend is used."""

    process: ProcessLaunchSpec = Field(default_factory=ProcessLaunchSpec)
    k8s: KubernetesLaunchSpec = Field(default_factory=KubernetesLaunchSpec)
    slurm: SlurmLaunchSpec = Field(default_factory=SlurmLaunchSpec)
    container: ContainerLaunchSpec = Field(default_factory=ContainerLaunchSpec)


class SiteSpec(Strict):
    """One site of a job, after ``@default`` has been merged in."""

    launcher: BackendName = "process"
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT, description="multiplies num_samples in FedAvg")
    retries: int = Field(0, ge=0, le=20)
    retry_delay_seconds: float = Field(10.0, ge=0, le=MAX_SECONDS)
    resource_spec: ResourceSpec = Field(default_factory=ResourceSpec)
    resource_manager: ResourceManagerSpec | None = None
    launcher_spec: LauncherSpec = Field(default_factory=LauncherSpec)
    queue: str | None = Field(
        None, description="Airflow queue of this site's tasks (its Edge or Celery worker); default: see site_queues"
    )
    executor: str | None = Field(
        None, description="Airflow executor of this site's tasks (e.g. EdgeExecutor); default: Airflow's default"
    )
    privacy: SitePrivacy | None = Field(
        None, description="the site's own filters and public names; a site policy's privacy block replaces it"
    )
    watch: Literal["task", "sensor"] = Field(
        "task",
        description="task: one site task launches and waits; sensor: a launch task, then a sensor that watches",
    )
    base_model: str | None = Field(
        None, description="this site's copy of a LoRA job's base model (default: lora.base_model.file)"
    )
    confinement: ProcessConfinement | None = Field(
        None, description="set by the site policy only (sites.<site>.confinement); None: the default, auto"
    )

    @field_validator("confinement")
    @classmethod
    def _policy_only(cls, value: ProcessConfinement | None, info: ValidationInfo) -> ProcessConfinement | None:
        # The site admin decides how trainers are confined; a job file that could say `mode: off`
        # would let any job author undo it.
        if value is not None and not (info.context or {}).get(SITE_POLICY_CONTEXT):
            raise ValueError(
                "confinement is the site admin's, not the job's: set it in the site policy "
                "(sites.<site>.confinement in the worker's FLARE_SITE_CONFIG file or flare_site_policy variable)"
            )
        return value

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str | None) -> str | None:
        return None if value is None else queue_name(value, "queue")

    @field_validator("executor")
    @classmethod
    def _executor(cls, value: str | None) -> str | None:
        return None if value is None else airflow_executor(value, "executor")

    @field_validator("launcher", mode="before")
    @classmethod
    def _supported(cls, value: Any) -> Any:
        return canonical(value) if isinstance(value, str) else value

    @property
    def backend(self) -> Backend:
        """The registry entry of the site's backend."""
        return backend(self.launcher)

    @property
    def block(self) -> Any:
        """The site's own launcher block (``launcher_spec.<launcher>``)."""
        return self.backend.block(self.launcher_spec)

    @model_validator(mode="after")
    def _image(self) -> SiteSpec:
        if self.backend.needs_image and self.block.image is None:
            raise ValueError(
                f"a {self.backend.title} site needs its trainer image: set launcher_spec.{self.launcher}.image "
                "(e.g. registry.example.org/fl/trainer:1.0, built from docker/Dockerfile.trainer)"
            )
        return self

    @property
    def nodes(self) -> int:
        """Nodes one site job spans (``nodes`` of the site's block where it has one; 1 otherwise)."""
        return int(getattr(self.block, "nodes", 1))

    @property
    def gpus_per_job(self) -> int:
        """GPUs one site job holds: ``num_of_gpus`` (per pod / per node) times its nodes (pool slots)."""
        return self.resource_spec.num_of_gpus * self.nodes

    @model_validator(mode="after")
    def _watchable(self) -> SiteSpec:
        if self.watch == "sensor" and not self.backend.watchable:
            watchable = " / ".join(b.name for b in BACKENDS.values() if b.watchable)
            raise ValueError(
                f"watch: sensor needs a site job that outlives the task that launched it, and a {self.launcher} "
                f"site's job ends with its task (by design): use watch: task (the default) for {self.launcher} "
                f"sites, or launcher {watchable}"
            )
        return self

    @model_validator(mode="after")
    def _gpus_fit(self) -> SiteSpec:
        wanted = self.gpus_per_job
        manager = self.resource_manager
        if wanted and manager is None:
            raise ValueError(
                f"a site job asks for {wanted} GPU(s) (resource_spec.num_of_gpus) but the site declares no "
                "resource_manager: add resource_manager: {type: gpu, num_of_gpus: <the site's GPUs>}, "
                "or {type: passthrough} if the backend enforces GPU limits itself"
            )
        devices = getattr(self.block, "gpu_devices", None)
        if devices is not None and self.resource_spec.num_of_gpus > len(devices):
            raise ValueError(
                f"a site job asks for {self.resource_spec.num_of_gpus} GPU(s) (resource_spec.num_of_gpus) but the "
                f"site's launcher_spec.{self.launcher}.gpu_devices lists {len(devices)}: list the host's GPUs there "
                "(e.g. nvidia.com/gpu=0) or lower num_of_gpus"
            )
        if manager is not None and manager.type == "gpu":
            if manager.num_of_gpus < 1:
                raise ValueError("resource_manager.num_of_gpus must be >= 1 for type 'gpu' (the site's GPUs)")
            if wanted > manager.num_of_gpus:
                per_node = (
                    f" ({self.resource_spec.num_of_gpus} per node x {self.nodes} nodes)" if self.nodes > 1 else ""
                )
                raise ValueError(
                    f"a site job asks for {wanted} GPUs{per_node} but the site has only {manager.num_of_gpus} "
                    "(resource_manager.num_of_gpus): it could never run -- Airflow would wait for pool "
                    "slots forever. Lower resource_spec.num_of_gpus or raise the site's capacity."
                )
        return self

    @property
    def runs_script_here(self) -> bool:
        """Whether the site runs ``trainer.script`` from this machine's file system (process sites,
        and SLURM sites submitting locally without a ``trainer_script`` of their own)."""
        block = self.block
        return self.backend.on_worker or (
            self.backend.argv == "cluster" and block.ssh_conn_id is None and block.trainer_script is None
        )

    def gpu_pool(self, site: str) -> str | None:
        """The Airflow pool of this site's GPUs (its ``gpu`` resource manager's), or ``None``
        (passthrough, or no resource manager)."""
        manager = self.resource_manager
        if manager is None or manager.type != "gpu":
            return None
        if manager.pool:
            return manager.pool
        return f"flare_gpu_{site}" + (f"_{manager.gpu_class}" if manager.gpu_class else "")

    def pool_name(self, site: str) -> str | None:
        """The Airflow pool bounding this site's GPU jobs, or ``None`` (no GPUs asked, passthrough)."""
        return self.gpu_pool(site) if self.resource_spec.num_of_gpus else None


def _mapping(value: Any, where: str, what: str) -> Mapping[str, Any]:
    """``value`` as a mapping (``None``: empty), or a ValueError naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping of {what}, got {type(value).__name__} {short_repr(value)}")
    return value


def _merge_block(*blocks: tuple[Any, str]) -> dict[str, Any]:
    """Shallow merge of ``(block, where)`` pairs, later wins; every block must be a mapping."""
    out: dict[str, Any] = {}
    for block, where in blocks:
        out.update(_mapping(block, where, "keys to values"))
    return out


def _backends(block: Any, where: str) -> dict[str, Any]:
    out = {}
    for key, value in _mapping(block, where, "backend -> settings (process, k8s, ...)").items():
        name = canonical(key) if isinstance(key, str) else key
        if name not in BACKENDS:
            raise ValueError(
                f"{where}: unknown launcher backend {short_repr(key)}; "
                f"allowed: {', '.join(BACKENDS)} (aliases: {', '.join(ALIASES)})"
            )
        out[name] = value
    return out


def _site_names(sites: list[Any]) -> dict[str, Any]:
    """NVFlare's short form ``sites: [site-1, site-2]``: every site with the defaults."""
    out: dict[str, Any] = {}
    for item in sites:
        if not isinstance(item, str):
            raise ValueError(f"sites: a list of sites holds site names, got {type(item).__name__} {short_repr(item)}")
        if item in out:
            raise ValueError(f"sites: site {item!r} is listed twice")
        out[item] = None
    return out


def merge_sites(sites: Any, top_resources: Any, top_launchers: Any) -> Any:
    """Fold ``@default`` and NVFlare's top-level ``resource_spec`` / ``launcher_spec`` into each site.

    Raises ``ValueError`` naming the block (e.g. ``sites.@default``) when one is not a mapping.
    """
    if sites is None:
        return sites
    if isinstance(sites, list):
        sites = _site_names(sites)
    if not isinstance(sites, Mapping):
        raise ValueError(
            f"sites must be a mapping of site name -> settings (or a list of site names), "
            f"got {type(sites).__name__} {short_repr(sites)}"
        )
    top_resources = _mapping(top_resources, "resource_spec", "site name -> resources")
    top_launchers = _mapping(top_launchers, "launcher_spec", "site name -> launcher blocks")
    default = _mapping(sites.get(DEFAULT_SITE), f"sites.{DEFAULT_SITE}", "settings every site shares")
    names = [n for n in sites if n != DEFAULT_SITE]
    for key, what in ((top_resources, "resource_spec"), (top_launchers, "launcher_spec")):
        for name in key:
            if name not in (DEFAULT_SITE, NVFLARE_DEFAULT) and name not in names:
                known = clip(", ".join(map(str, names)), 200)
                raise ValueError(f"{what} names site {short_repr(name)}, which is not in sites ({known})")
    merged: dict[str, Any] = {}
    for name in names:
        own = _mapping(sites[name], f"sites.{name}", "settings (or empty for the defaults)")
        site = {**default, **own}
        site["resource_spec"] = _merge_block(
            (top_resources.get(DEFAULT_SITE), f"resource_spec.{DEFAULT_SITE}"),
            (top_resources.get(NVFLARE_DEFAULT), f"resource_spec.{NVFLARE_DEFAULT}"),
            (default.get("resource_spec"), f"sites.{DEFAULT_SITE}.resource_spec"),
            (top_resources.get(name), f"resource_spec.{name}"),
            (own.get("resource_spec"), f"sites.{name}.resource_spec"),
        )
        layers = [
            (_backends(top_launchers.get(NVFLARE_DEFAULT), "launcher_spec.default"), "launcher_spec.default"),
            (_backends(default.get("launcher_spec"), "sites.@default.launcher_spec"), "sites.@default.launcher_spec"),
            (_backends(top_launchers.get(name), f"launcher_spec.{name}"), f"launcher_spec.{name}"),
            (_backends(own.get("launcher_spec"), f"sites.{name}.launcher_spec"), f"sites.{name}.launcher_spec"),
        ]
        site["launcher_spec"] = {
            name: _merge_block(*((layer[name], f"{where}.{name}") for layer, where in layers if name in layer))
            for name in SUPPORTED_BACKENDS
            if any(name in layer for layer, _ in layers)
        }
        merged[name] = site
    return merged
