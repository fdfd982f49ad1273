"""Site policy: what a site's admin decides, read at the site (on the site's worker) at run time.

A policy file (YAML, the path in ``$FLARE_SITE_CONFIG`` or Airflow's ``[flare] site_config`` on the
worker) -- or, without a file, the Airflow variable ``flare_site_policy`` as the worker resolves it
(its ``AIRFLOW_VAR_FLARE_SITE_POLICY``, its secrets backend, then the metastore) -- holds one entry
per site the worker serves::

    sites:
      site-1:
        launcher: process
        resource_manager: {type: gpu, num_of_gpus: 2}      # the site's GPUs: the most a job may ask
        launcher_spec:
          process: {cwd: /data/site-1, env: {OMP_NUM_THREADS: "4"}, secret_env: {...}}
        store_conn_id: flare_store                         # the Airflow connection to the model store
        privacy:                                           # what leaves the site (docs/privacy.md)
          filters: [{type: gaussian, clip: 1.0, noise_multiplier: 1.0}]
          delta: 1.0e-5
          public_metrics: [train_loss]
        confinement: {mode: auto, network: false}          # process sites: how trainers are confined

The job asks, the site decides. For a site with a policy, the job's ``resource_spec`` (GPUs, CPUs,
memory), ``weight``, ``retries`` and queue still come from the job; the launcher, the resource
manager (GPU limit), the whole ``launcher_spec`` (paths, environment, secrets, images, volumes)
and the site's ``privacy`` come from the policy only -- whatever the job file says for them is not
used (the job's top-level ``privacy`` may add filters, never remove the site's). ``confinement``
(how a process site's trainers are confined, ``docs/confinement.md``) is the policy's alone: a job
file cannot set it, and without a policy it is ``auto``. A request beyond
the policy's limits fails that site's task with a :class:`~flare_airflow.core.errors.ConfigError`.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from flare_airflow.core import envvars
from flare_airflow.core.backends import BackendName, backend
from flare_airflow.core.config.container import protected_mount_problem
from flare_airflow.core.config.describe import cap, describe
from flare_airflow.core.config.job import JobConfig
from flare_airflow.core.config.privacy import SitePrivacy
from flare_airflow.core.config.process import ProcessConfinement
from flare_airflow.core.config.resources import ResourceManagerSpec
from flare_airflow.core.config.site import (
    SITE_POLICY_CONTEXT,
    SUPPORTED_BACKENDS,
    LauncherSpec,
    SiteSpec,
    merge_sites,
)
from flare_airflow.core.config.validators import Strict, conn_id_name
from flare_airflow.core.config.yaml_loader import parse_job_yaml_text, read_job_yaml
from flare_airflow.core.errors import ConfigError

SITE_CONFIG_ENV = envvars.FLARE_SITE_CONFIG
# The Airflow variable that may hold the policy instead of a file (same YAML or JSON document).
SITE_POLICY_VARIABLE = "flare_site_policy"
# What the policy owns: the job's values for these are replaced, never merged.
POLICY_FIELDS = ("launcher", "resource_manager", "launcher_spec", "privacy", "confinement")


class SitePolicyEntry(Strict):
    """One site's policy: its backend, its GPUs, its launcher blocks, its store connection, its privacy."""

    launcher: BackendName = "process"
    resource_manager: ResourceManagerSpec | None = None
    launcher_spec: dict[str, Any] = Field(default_factory=dict, description="process / k8s blocks")
    store_conn_id: str | None = Field(None, description="Airflow connection of the model store at this site")
    privacy: SitePrivacy | None = Field(
        None, description="filters applied to every update before it leaves, and what else may leave (privacy.md)"
    )
    confinement: ProcessConfinement | None = Field(
        None, description="process sites: how trainers are confined (default: mode auto)"
    )

    @field_validator("store_conn_id")
    @classmethod
    def _conn(cls, value: str | None) -> str | None:
        return None if value is None else conn_id_name(value, "store_conn_id")

    @field_validator("launcher_spec")
    @classmethod
    def _backends(cls, value: dict[str, Any]) -> dict[str, Any]:
        # each block checked now, where the admin reads the error, as the admin's (the site policy's)
        LauncherSpec.model_validate(value, context={SITE_POLICY_CONTEXT: True})
        unknown = [k for k in value if k not in SUPPORTED_BACKENDS]
        if unknown:
            raise ValueError(
                f"unknown backend(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(SUPPORTED_BACKENDS)}"
            )
        return value

    @model_validator(mode="after")
    def _confinement_of_process_sites(self) -> SitePolicyEntry:
        confined_by = backend(self.launcher).confined_by
        if self.confinement is not None and confined_by is not None:
            raise ValueError(
                f"confinement applies to process sites; a {self.launcher!r} site's trainers are confined by "
                f"{confined_by}: remove it"
            )
        return self


class SitePolicy(Strict):
    """A site policy file: the sites this worker serves."""

    sites: dict[str, SitePolicyEntry]
    _source: str = PrivateAttr("<python>")

    @property
    def source(self) -> str:
        return self._source

    def entry(self, site: str) -> SitePolicyEntry:
        if site not in self.sites:
            covered = ", ".join(self.sites) or "no site"
            raise ConfigError(
                f"site {site!r}: this worker's site policy {self.source} covers only {covered}"
                f"; a task of site {site!r} reached a worker of another site -- check the site's queue "
                f"(site_queues / sites.{site}.queue) and which queues this worker serves (--queues)"
            )
        return self.sites[site]


def site_policy_from_dict(data: Mapping[str, Any], *, source: str = "<python>") -> SitePolicy:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: a site policy must be a mapping (sites: {{<site>: ...}}), got {type(data).__name__}"
        )
    try:
        policy = SitePolicy.model_validate(data)
    except ValidationError as exc:
        text = describe(exc, source, SitePolicy, ("sites",))
        raise ConfigError(text.replace("invalid job configuration", "invalid site policy", 1)) from None
    policy._source = source
    return policy


def load_site_policy(path: str | pathlib.Path) -> SitePolicy:
    """Read and validate a site policy file (the same YAML reader and limits as job files)."""
    path = pathlib.Path(path)
    where = f"site policy ({SITE_CONFIG_ENV} / [flare] site_config)"
    return _parsed_policy(lambda: read_job_yaml(path), str(path), where, "the site policy file")


def site_policy_from_text(text: str, source: str) -> SitePolicy:
    """Validate a site policy given as YAML or JSON text (e.g. an Airflow variable's value); ``source``
    names where it came from in every error."""
    return _parsed_policy(lambda: parse_job_yaml_text(text, source)[0], source, "site policy", "the site policy")


def _parsed_policy(read: Callable[[], Mapping[str, Any]], source: str, what: str, noun: str) -> SitePolicy:
    try:
        data = read()
    except ConfigError as exc:
        text = str(exc).replace("the job file", noun).replace("(job: ..., rounds: ..., sites: ...)", "(sites: ...)")
        raise ConfigError(f"{what}: {text}") from None
    return site_policy_from_dict(data, source=source)


def _protected_mounts(block: Any, job: JobConfig, where: str) -> None:
    """A container site's volumes never expose the model store or AIRFLOW_HOME, whoever wrote them."""
    if block is None:
        return
    home = os.path.abspath(os.path.expanduser(os.environ.get("AIRFLOW_HOME") or "~/airflow"))
    protected = {"AIRFLOW_HOME": home}
    if job.store_scheme == "file" and job.store:
        protected["the model store"] = os.path.abspath(job.store.removeprefix("file://"))
    for volume in block.volumes:
        problem = protected_mount_problem(volume.host_path, protected)
        if problem is not None:
            raise ConfigError(cap(f"{where}: {problem}"))


def apply_site_policy(job: JobConfig, site: str, policy: SitePolicy) -> JobConfig:
    """The job as ``site`` runs it: the job's request on top of the site's policy.

    Raises :class:`ConfigError` naming the policy file and the site when the job's request does not
    fit the policy (more GPUs than the site has, a launcher other than the site's).
    """
    entry = policy.entry(site)
    asked = job.sites[site]
    where = f"site {site!r} (site policy {policy.source})"
    if asked.launcher != entry.launcher:
        raise ConfigError(
            f"{where}: the site runs its jobs with launcher {entry.launcher!r} but this job's DAG built a "
            f"{asked.launcher!r} task for it; set sites.{site}.launcher: {entry.launcher} in the job file"
        )
    request = asked.model_dump(exclude=set(POLICY_FIELDS), exclude_none=True)
    merged = {**request, "launcher": entry.launcher, "launcher_spec": entry.launcher_spec}
    if entry.resource_manager is not None:
        merged["resource_manager"] = entry.resource_manager.model_dump()
    if entry.privacy is not None:
        merged["privacy"] = entry.privacy.model_dump()
    if entry.confinement is not None:
        merged["confinement"] = entry.confinement
    try:
        spec = SiteSpec.model_validate(
            merge_sites({site: merged}, None, None)[site], context={SITE_POLICY_CONTEXT: True}
        )
    except ValidationError as exc:
        reasons = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        raise ConfigError(cap(f"{where}: the job's request does not fit the site's policy: {reasons}")) from None
    _protected_mounts(spec.launcher_spec.container, job, where)
    if spec.gpus_per_job != asked.gpus_per_job:
        # The task's pool slots were fixed when the DAG was parsed, from the job's nodes x GPUs:
        # a job spanning more nodes here would hold fewer slots than the GPUs it takes.
        raise ConfigError(
            f"{where}: the site runs a site job on {spec.nodes} node(s) x {spec.resource_spec.num_of_gpus} GPU(s) "
            f"= {spec.gpus_per_job} GPU(s), but this job's DAG took {asked.gpus_per_job} pool slot(s) for it "
            f"({asked.nodes} node(s)); set the site's nodes in the job file to {spec.nodes}"
        )
    update: dict[str, Any] = {"sites": {**job.sites, site: spec}}
    if entry.store_conn_id is not None:
        update["store_conn_id"] = entry.store_conn_id  # the site's own credentials to the store
    at_site = job.model_copy(update=update)
    at_site.privacy_plan(site, where)  # the job's privacy against the site's: refused here, before the launch
    return at_site
