"""The job: its trainer (:mod:`.trainer`), rounds, quorum, store and sites, and the checks across them.

Build one with :func:`load_job` (a YAML file) or :func:`job_from_dict` (a Python mapping). Every
error names the file, the field and the site, and says what is allowed.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from flare_airflow.core.aggregation.central_dp import central_dp_problem, with_central_dp
from flare_airflow.core.aggregation.strategies import Strategy
from flare_airflow.core.config.aggregator import AggregatorSpec, FedAvgSpec, strategy_hparams_to_trainer
from flare_airflow.core.config.describe import cap, clip, describe, field_in_message, located, short_repr
from flare_airflow.core.config.lora import LoraSpec
from flare_airflow.core.config.privacy import JobPrivacy, site_privacy_plan
from flare_airflow.core.config.site import SiteSpec, merge_sites
from flare_airflow.core.config.tracking import TrackingSpec
from flare_airflow.core.config.trainer import TrainerSpec
from flare_airflow.core.config.trigger import OnData, TriggerSpec
from flare_airflow.core.config.validators import (
    DNS_LABEL,
    Strict,
    conn_id_name,
    no_nul,
    not_blank,
)
from flare_airflow.core.config.yaml_loader import KeyLines, read_job_yaml_with_lines
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.privacy.plan import PrivacyPlan

_JOB_NAME = re.compile(r"^[a-z0-9]([-a-z0-9_]*[a-z0-9])?\Z")
# Airflow's own schedule presets beyond cron's (airflow.sdk.definitions.dag._create_timetable).
_SCHEDULE_PRESETS = ("@once", "@continuous")
_CRON_PRESETS = {"@quarterly": "0 0 1 */3 *"}
# Store URI schemes a run can use: the local file system and the object stores Airflow's
# ObjectStoragePath reaches through fsspec (the backend package must be installed where tasks run).
STORE_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs", "webhdfs", "sftp")


class JobConfig(Strict):
    """A federated job. Build it with :func:`load_job` (YAML) or :func:`job_from_dict` (Python)."""

    job: str = Field(description="job name: lowercase letters, digits, '-' and '_'")
    rounds: int = Field(ge=1, le=1000, description="maximum number of rounds (the UI form may ask for fewer)")
    min_clients: int = Field(ge=1, description="valid updates needed for a round to count")
    trainer: TrainerSpec
    initial_model: str = Field(description="safetensors file with the initial global model")
    store: str | None = Field(None, description="model store URI; default <AIRFLOW_HOME>/flare_store")
    store_conn_id: str | None = Field(
        None, description="Airflow connection of an object store (a name: each side defines its own credentials)"
    )
    aggregator: AggregatorSpec = Field(default_factory=FedAvgSpec)
    evaluate: bool = Field(True, description="evaluate each new global model with the trainer (task 'evaluate')")
    schedule: str | None = Field(None, description="Airflow schedule for recurring runs")
    warm_start: bool = Field(False, description="default of the run form's warm-start switch")
    trigger: TriggerSpec | None = Field(
        None, description="what starts runs besides the form: on_data, the sites' data announcements"
    )
    check_pools: bool = Field(True, description="check the sites' GPU pools when a run starts")
    site_queues: bool = Field(
        False, description="each site's tasks go to the Airflow queue named after the site (unless it sets queue)"
    )
    privacy: JobPrivacy = Field(
        default_factory=JobPrivacy, description="filters added at every site, the (ε, δ) account, the budget"
    )
    tracking: TrackingSpec | None = Field(
        None,
        description="experiment tracking of each run (docs/tracking.md); false: none, whatever the deployment default",
    )
    lora: LoraSpec | None = Field(
        None, description="LoRA adapter fine-tuning of a base model each site keeps, pinned by digest (docs/llm.md)"
    )
    sites: dict[str, SiteSpec]
    base_dir: str = Field(".", description="directory relative paths are resolved against")

    @model_validator(mode="before")
    @classmethod
    def _merge_sites(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        strategy_hparams_to_trainer(data)
        data["sites"] = merge_sites(data.get("sites"), data.pop("resource_spec", None), data.pop("launcher_spec", None))
        return data

    @field_validator("tracking", mode="before")
    @classmethod
    def _tracking_off(cls, value: Any) -> Any:
        # `tracking: false` is "not tracked" said out loud: the deployment default does not apply
        # (it applies to a job that leaves tracking out, see flare_airflow.operators.tracking).
        return None if value is False else value

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str | None) -> str | None:
        if value is None or value in _SCHEDULE_PRESETS:
            return value
        no_nul(value, "schedule")
        try:
            # Airflow's own cron parser; imported here only (core does not import Airflow).
            from croniter import croniter
        except ImportError:  # pragma: no cover - croniter comes with Airflow
            return value
        try:
            croniter(_CRON_PRESETS.get(value, value))
        except Exception as exc:  # croniter's errors have no common base beyond ValueError/KeyError
            raise ValueError(
                f"schedule {short_repr(value)} is not a cron expression ({clip(str(exc), 120)}): use five "
                "fields like '0 3 * * 1' (Mondays 03:00), a preset (@hourly, @daily, @weekly, @monthly, "
                "@quarterly, @yearly, @once, @continuous), or leave it out for manual runs"
            ) from None
        return value

    @field_validator("store")
    @classmethod
    def _store(cls, value: str | None) -> str | None:
        if value is None:
            return None
        no_nul(value, "store")
        if not value.strip():
            raise ValueError("must not be empty (leave it out for <AIRFLOW_HOME>/flare_store)")
        if "://" not in value:
            return value  # a local directory, relative to the job file
        scheme, _, rest = value.partition("://")
        if scheme not in STORE_SCHEMES:
            raise ValueError(
                f"store {short_repr(value)}: unknown scheme {short_repr(scheme)}; use a directory, file:///path, "
                f"or an object store URI ({', '.join(s + '://' for s in STORE_SCHEMES if s != 'file')})"
            )
        if scheme == "file" and not rest.startswith("/"):
            raise ValueError(f"store {short_repr(value)}: a file:// URI needs an absolute path (file:///data/store)")
        if scheme != "file" and not rest.split("/")[0]:
            raise ValueError(f"store {short_repr(value)}: name the bucket or host ({scheme}://<bucket>/<prefix>)")
        return value

    @field_validator("store_conn_id")
    @classmethod
    def _store_conn_id(cls, value: str | None) -> str | None:
        return None if value is None else conn_id_name(value, "store_conn_id")

    @field_validator("initial_model", "base_dir")
    @classmethod
    def _path(cls, value: str) -> str:
        return not_blank(value, "path", "must name a file (paths are relative to the job file)")

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
            if not DNS_LABEL.match(name) or len(name) > 63:
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
        self._one_size_per_pool()
        self._data_trigger_fits()
        self._watched_jobs_reach_the_store()
        problem = self.aggregator.quorum_problem(self.min_clients, len(self.sites))
        if problem is not None:
            raise ValueError(problem)
        if any(s.runs_script_here for s in self.sites.values()) and not self.script_path().is_file():
            raise ValueError(
                f"trainer.script {self.trainer.script!r} does not exist (looked at {self.script_path()}); "
                "paths are relative to the job file"
            )
        if self.privacy.central is not None and (problem := central_dp_problem(self.aggregator.strategy())):
            raise ValueError(problem)
        for site in self.sites:
            self.privacy_plan(site, f"sites.{site}")  # the job's own privacy errors show at parse time
        if not self.initial_model_path().is_file():
            what = "is not a file" if self.initial_model_path().exists() else "does not exist"
            raise ValueError(
                f"initial_model {self.initial_model!r} {what} (looked at {self.initial_model_path()}); "
                "give a safetensors file, relative to the job file"
            )
        return self

    @property
    def store_scheme(self) -> str:
        """The model store's URI scheme: ``file`` for a directory (and for the default store)."""
        return self.store.partition("://")[0] if self.store and "://" in self.store else "file"

    def _watched_jobs_reach_the_store(self) -> None:
        """A job watched by a sensor (``watch: sensor``) outlives the task that launched it, so it must
        reach the store itself; a backend whose jobs see only files staged on the worker cannot,
        when the store is an object store (nothing would be left to upload the update)."""
        if self.store_scheme == "file":
            return
        for name, site in self.sites.items():
            if site.watch == "sensor" and site.backend.store_as_files:
                raise ValueError(
                    f"sites.{name}.watch: sensor cannot publish a {site.backend.title} site's update to the object "
                    f"store {short_repr(self.store)}: its job sees only the files its site task stages on the worker "
                    "(the global model in, the update out), and with a sensor that task ends at the launch; "
                    f"use watch: task (the default) for {name}, or a local store (a directory or file:///path)"
                )

    @property
    def on_data(self) -> OnData | None:
        return self.trigger.on_data if self.trigger is not None else None

    def _data_trigger_fits(self) -> None:
        on_data = self.on_data
        if on_data is None:
            return
        if on_data.min_sites > len(self.sites):
            raise ValueError(
                f"trigger.on_data.min_sites is {on_data.min_sites} but the job has only {len(self.sites)} site(s) "
                f"({', '.join(self.sites)}): no run could ever start; lower min_sites or add sites"
            )
        if on_data.min_sites < self.min_clients:
            raise ValueError(
                f"trigger.on_data.min_sites is {on_data.min_sites}, below min_clients {self.min_clients}: a run "
                "over that many fresh sites could never reach its quorum; raise min_sites or lower min_clients"
            )
        if self.schedule in _SCHEDULE_PRESETS:
            raise ValueError(
                f"schedule {self.schedule} with trigger.on_data: the schedule is the fallback that runs over the fresh "
                "sites when no run happened in a whole period; use a cron expression or preset such as @weekly"
            )

    def _one_size_per_pool(self) -> None:
        """Sites sharing a GPU pool (several sites on one GPU host) must agree on its GPUs: the pool's
        slots are those GPUs, and with two counts its size would be whichever was synced last."""
        first: dict[str, tuple[str, int]] = {}
        for name, site in self.sites.items():
            pool = site.gpu_pool(name)
            if pool is None or site.resource_manager is None:
                continue
            gpus = site.resource_manager.num_of_gpus
            other, other_gpus = first.setdefault(pool, (name, gpus))
            if other_gpus != gpus:
                raise ValueError(
                    f"sites.{name}.resource_manager.num_of_gpus is {gpus}, but sites {other} and {name} share GPU "
                    f"pool {pool!r} and site {other} declares {other_gpus} (sites.{other}.resource_manager."
                    "num_of_gpus): one pool has one size; give both sites the pool's GPU count, or each site a "
                    "pool of its own"
                )

    def resolve(self, relative: str) -> pathlib.Path:
        path = pathlib.Path(relative).expanduser()
        return path if path.is_absolute() else (pathlib.Path(self.base_dir) / path).resolve()

    def script_path(self) -> pathlib.Path:
        return self.resolve(self.trainer.script)

    def initial_model_path(self) -> pathlib.Path:
        return self.resolve(self.initial_model)

    def site_queue(self, site: str) -> str | None:
        """The Airflow queue of ``site``'s tasks: its own ``queue``, else its name when ``site_queues``
        is on, else ``None`` (Airflow's default queue: the one-machine deployment)."""
        spec = self.sites[site]
        if spec.queue is not None:
            return spec.queue
        return site if self.site_queues else None

    def privacy_plan(self, site: str, where: str | None = None) -> PrivacyPlan | None:
        """The privacy plan ``site``'s task applies: its own privacy block (the site policy's, once
        :func:`~flare_airflow.core.config.policy.apply_site_policy` ran) and the job's; None if neither has one."""
        return site_privacy_plan(self.sites[site].privacy, self.privacy, site, where or f"site {site!r}")

    def round_strategy(self, central_noise_key: Callable[[], bytes]) -> Strategy:
        """The strategy one round runs, assembled once from the job: the aggregator's (its config
        union picks the class), wrapped in central DP when ``privacy.central`` is set -- as Flower
        wraps DP around the inner strategy. ``central_noise_key`` is called only then: the round's
        noise key (:func:`~flare_airflow.core.privacy.central.central_noise_key`), resolved by
        whoever holds the run's secret."""
        strategy = self.aggregator.strategy()
        central = self.privacy.central
        if central is None:
            return strategy
        return with_central_dp(
            strategy,
            clip=central.clip,
            noise_multiplier=central.noise_multiplier,
            num_sites=len(self.sites),
            key=central_noise_key(),
        )

    def base_model_path(self, site: str) -> pathlib.Path | None:
        """Where ``site`` keeps the LoRA job's base model (its own ``base_model``, else the job's
        ``lora.base_model.file``, as for the server's evaluation); ``None`` for a job without ``lora``."""
        if self.lora is None:
            return None
        spec = self.sites.get(site)
        return self.resolve((spec.base_model if spec is not None else None) or self.lora.base_model.file)

    def site_weights(self) -> dict[str, float]:
        return {name: site.weight for name, site in self.sites.items()}


# NVFlare's top-level blocks are folded into the sites before validation, so they are no fields;
# base_dir is set by the loader (the job file's folder), not written by authors.
TOP_LEVEL_KEYS = (*(k for k in JobConfig.model_fields if k != "base_dir"), "resource_spec", "launcher_spec")


def job_from_dict(
    data: Mapping[str, Any],
    *,
    source: str = "<python>",
    base_dir: str | None = None,
    lines: KeyLines | None = None,
) -> JobConfig:
    """Validate a job given as a Python mapping (the same shape as the YAML file)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a job must be a mapping of keys to values, got {type(data).__name__}")
    payload = dict(data)
    if base_dir is not None:
        payload.setdefault("base_dir", base_dir)
    try:
        return JobConfig.model_validate(payload)
    except ValidationError as exc:
        raise ConfigError(describe(exc, source, JobConfig, TOP_LEVEL_KEYS, lines)) from None
    except ValueError as exc:  # raised while merging sites, before field validation; names its block
        where = located(source, lines, field_in_message(str(exc)))
        raise ConfigError(f"invalid job configuration:\n  {cap(f'{where}: {exc}')}") from None


def load_job(path: str | pathlib.Path) -> JobConfig:
    """Load and validate a job YAML file; relative paths in it are relative to the file.

    Every error names the file and the line of the field it is about.
    """
    path = pathlib.Path(path)
    data, lines = read_job_yaml_with_lines(path)
    return job_from_dict(data, source=str(path), base_dir=str(path.parent.resolve()), lines=lines)
