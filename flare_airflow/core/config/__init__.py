"""Job configuration: one validated model for YAML and Python jobs.

A job names its trainer, its rounds, its quorum and its sites. Sites follow NVIDIA FLARE's job
meta: a ``@default`` site entry, ``resource_spec`` (``num_of_gpus``, ``num_of_cpus``, ``memory``)
and ``launcher_spec`` blocks per backend, merged shallowly (:mod:`.site`).

One module per concern: :mod:`.yaml_loader` reads the file, :mod:`.job` holds the job, :mod:`.trainer`
its trainer, :mod:`.site` the sites, :mod:`.resources` what a site job asks for, :mod:`.process` and
:mod:`.kubernetes` (with :mod:`.volumes`) and :mod:`.slurm` each backend's site policy, :mod:`.describe` turns
validation errors into short messages, :mod:`.checks` reads the initial model and the store backend.
The names below are the public ones; import them from here.
"""

from flare_airflow.core.config.checks import check_store_backend, load_initial_model, load_model_file
from flare_airflow.core.config.container import ContainerLaunchSpec, ContainerVolume
from flare_airflow.core.config.describe import MAX_ERROR_LINE, MAX_ERROR_LINES, MAX_REPR, reprlib_repr, short_repr
from flare_airflow.core.config.job import STORE_SCHEMES, AggregatorSpec, JobConfig, job_from_dict, load_job
from flare_airflow.core.config.kubernetes import (
    MANAGED_BY_LABEL,
    RESERVED_LABEL_PREFIX,
    KubernetesLaunchSpec,
    SecretRef,
)
from flare_airflow.core.config.policy import (
    SITE_CONFIG_ENV,
    SITE_POLICY_VARIABLE,
    SitePolicy,
    SitePolicyEntry,
    apply_site_policy,
    load_site_policy,
    site_policy_from_dict,
    site_policy_from_text,
)
from flare_airflow.core.config.process import (
    CONNECTION_FIELDS,
    RESERVED_PROCESS_ENV_PREFIXES,
    AirflowSecretRef,
    ProcessLaunchSpec,
)
from flare_airflow.core.config.resources import ResourceManagerSpec, ResourceSpec
from flare_airflow.core.config.site import (
    DEFAULT_SITE,
    NVFLARE_DEFAULT,
    SUPPORTED_BACKENDS,
    LauncherSpec,
    SiteSpec,
    merge_sites,
)
from flare_airflow.core.config.slurm import SlurmLaunchSpec
from flare_airflow.core.config.tracking import TRACKING_BACKENDS, TrackingSpec, deployment_tracking
from flare_airflow.core.config.trainer import TrainerSpec
from flare_airflow.core.config.validators import (
    MAX_FORM_INT,
    MAX_SECONDS,
    MAX_WEIGHT,
    MIN_WEIGHT,
    RESERVED_ENV_PREFIX,
    Scalar,
)
from flare_airflow.core.config.volumes import (
    SCRATCH_PATH,
    SCRATCH_VOLUME,
    STORE_VOLUME,
    SYSTEM_HOST_PATHS,
    SYSTEM_MOUNT_PATHS,
    StoreMount,
    VolumeSpec,
    path_within,
)
from flare_airflow.core.config.yaml_loader import MAX_EXPANDED_NODES, MAX_JOB_FILE_BYTES, MAX_NESTING

__all__ = [
    "CONNECTION_FIELDS",
    "DEFAULT_SITE",
    "MANAGED_BY_LABEL",
    "MAX_ERROR_LINE",
    "MAX_ERROR_LINES",
    "MAX_EXPANDED_NODES",
    "MAX_FORM_INT",
    "MAX_JOB_FILE_BYTES",
    "MAX_NESTING",
    "MAX_REPR",
    "MAX_SECONDS",
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "NVFLARE_DEFAULT",
    "RESERVED_ENV_PREFIX",
    "RESERVED_LABEL_PREFIX",
    "RESERVED_PROCESS_ENV_PREFIXES",
    "SCRATCH_PATH",
    "SCRATCH_VOLUME",
    "SITE_CONFIG_ENV",
    "SITE_POLICY_VARIABLE",
    "STORE_SCHEMES",
    "STORE_VOLUME",
    "SUPPORTED_BACKENDS",
    "SYSTEM_HOST_PATHS",
    "SYSTEM_MOUNT_PATHS",
    "TRACKING_BACKENDS",
    "AggregatorSpec",
    "AirflowSecretRef",
    "ContainerLaunchSpec",
    "ContainerVolume",
    "JobConfig",
    "KubernetesLaunchSpec",
    "LauncherSpec",
    "ProcessLaunchSpec",
    "ResourceManagerSpec",
    "ResourceSpec",
    "Scalar",
    "SecretRef",
    "SitePolicy",
    "SitePolicyEntry",
    "SiteSpec",
    "SlurmLaunchSpec",
    "StoreMount",
    "TrackingSpec",
    "TrainerSpec",
    "VolumeSpec",
    "apply_site_policy",
    "check_store_backend",
    "deployment_tracking",
    "job_from_dict",
    "load_initial_model",
    "load_job",
    "load_model_file",
    "load_site_policy",
    "merge_sites",
    "path_within",
    "reprlib_repr",
    "short_repr",
    "site_policy_from_dict",
    "site_policy_from_text",
]
