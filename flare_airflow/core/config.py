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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from flare_airflow.core.errors import ConfigError

# libyaml's parser when PyYAML was built with it (the wheels are): ~5x faster on a 1024-site job,
# whose YAML every task process parses again.
try:
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # PyYAML without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]

DEFAULT_SITE = "@default"
NVFLARE_DEFAULT = "default"
BACKENDS = ("process", "k8s", "docker", "slurm")
BACKEND_ALIASES = {"kubernetes": "k8s"}
SUPPORTED_BACKENDS = ("process", "k8s")

_SITE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_JOB_NAME = re.compile(r"^[a-z0-9]([-a-z0-9_]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# Labels the pod builder sets itself (flare_airflow.launchers.kubernetes.pod_labels).
RESERVED_LABEL_PREFIX = "flare-airflow/"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# Names of the Client API's variables (and of what the launcher adds) belong to flare-airflow.
RESERVED_ENV_PREFIX = "FLARE_"
STORE_VOLUME = "flare-store"
SCRATCH_VOLUME = "flare-scratch"
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


def _dns_label(value: str, what: str) -> str:
    if not _SITE_NAME.match(value) or len(value) > 63:
        raise ValueError(
            f"{what} {value!r} is not an RFC 1123 label: use lowercase letters, digits and '-', "
            "start and end with a letter or digit, at most 63 characters"
        )
    return value


def _dns_subdomain(value: str, what: str) -> str:
    if not _DNS_SUBDOMAIN.match(value) or len(value) > 253:
        raise ValueError(
            f"{what} {value!r} is not a Kubernetes object name: use lowercase letters, digits, '-' and '.', "
            "start and end with a letter or digit, at most 253 characters"
        )
    return value


def _qualified_name(value: str, what: str) -> str:
    """A label or annotation key: ``[prefix/]name`` (prefix a DNS subdomain, name <= 63 characters)."""
    prefix, _, name = value.rpartition("/")
    ok = bool(name) and len(name) <= 63 and bool(_LABEL_VALUE.match(name))
    if prefix:
        ok = ok and len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.match(prefix))
    if not ok:
        raise ValueError(
            f"{what} {value!r} is not a valid key: an optional DNS prefix and '/', then at most 63 letters, "
            "digits, '-', '_' or '.', starting and ending with a letter or digit (e.g. 'team' or 'example.org/team')"
        )
    return value


def _label_value(value: str, what: str) -> str:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise ValueError(
            f"{what} {value!r} is not a valid label value: at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return value


def _argv(value: Any) -> Any:
    """An exact argv: a list of strings (numbers are turned into strings), never one shell string."""
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


def _env_name(name: str, what: str) -> str:
    if not _ENV_NAME.match(name):
        raise ValueError(f"{what}: {name!r} is not a valid environment variable name (letters, digits, '_', '-', '.')")
    if name.startswith(RESERVED_ENV_PREFIX):
        raise ValueError(f"{what}: {name!r} is reserved: FLARE_* variables are set by flare-airflow for the Client API")
    return name


def _absolute_path(value: str, what: str) -> str:
    """A normalised absolute path (no '.', '..', '//', ':' or control characters); a trailing '/' is dropped."""
    path = value.rstrip("/") or "/"
    if (
        not value.startswith("/")
        or ".." in value
        or "//" in value
        or ":" in value
        or any(part == "." for part in path.split("/"))
        or any(ord(c) < 32 or ord(c) == 127 for c in value)
    ):
        raise ValueError(
            f"{what} {value!r} must be a plain absolute path: no '..', '.', '//', ':' or control characters"
        )
    return path


def _within(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top + "/")


# Host directories no pod may mount: the node's own system, the kubelet's and the container
# runtimes' state (other pods' Secrets, images, sockets), logs of other pods. A host path inside one
# of them or above one of them (e.g. /var, which holds /var/run) is refused.
SYSTEM_HOST_PATHS = (
    "/etc",
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/root",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/run",
    "/var/run",
    "/var/lock",
    "/var/log",
    "/var/lib/kubelet",
    "/var/lib/docker",
    "/var/lib/containerd",
    "/var/lib/containers",
    "/var/lib/cri-o",
    "/var/lib/etcd",
    "/var/lib/cni",
    "/opt/cni",
)
# Directories of the trainer's image a volume must not shadow (or contain, e.g. /var).
SYSTEM_MOUNT_PATHS = (
    "/etc",
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/root",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/run",
    "/var/run",
    "/var/lib",
)
# The pod's writable scratch directory (an emptyDir; the root filesystem is read-only).
SCRATCH_PATH = "/tmp"  # noqa: S108 - a pod's own emptyDir, not the host's /tmp
_LIB_DIR = re.compile(r"^/lib[^/]*(/|$)")  # /lib, /lib32, /lib64, /libx32 ...


def _system_dir(path: str, system: tuple[str, ...]) -> str | None:
    """The system directory ``path`` is in, is, or contains; ``None`` if it stays clear of all of them."""
    if path == "/":
        return "/"
    if _LIB_DIR.match(path):
        return "/" + path.split("/")[1]
    return next((top for top in system if _within(path, top) or _within(top, path)), None)


def _host_path(value: str, what: str) -> str:
    path = _absolute_path(value, what)
    system = _system_dir(path, SYSTEM_HOST_PATHS)
    if system is not None:
        where = "the node's root" if system == "/" else f"the node's system directory {system}"
        raise ValueError(
            f"{what} {value!r} would expose {where} to the trainer: mount a data directory of its own (or use a PVC)"
        )
    return path


def _mount_path(value: str, what: str) -> str:
    path = _absolute_path(value, what)
    system = _system_dir(path, SYSTEM_MOUNT_PATHS)
    if system is not None:
        where = "the whole container filesystem" if system == "/" else f"the image's {system}"
        raise ValueError(f"{what} {value!r} would shadow {where}: mount it under a directory of its own, e.g. /data")
    if path == SCRATCH_PATH:
        raise ValueError(
            f"{what} {value!r} is the pod's scratch directory (an emptyDir flare-airflow mounts there, "
            "the root filesystem being read-only); choose another path"
        )
    return path


class SecretRef(_Strict):
    """A key of a Kubernetes Secret in the site's namespace; the value never appears in a spec."""

    secret: str = Field(description="name of the Secret")
    key: str = Field(description="key inside the Secret")

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: str) -> str:
        return _dns_subdomain(value, "secret name")

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if not _SECRET_KEY.match(value) or len(value) > 253:
            raise ValueError(f"secret key {value!r} may contain only letters, digits, '-', '_' and '.'")
        return value


def _exactly_one(what: str, **sources: Any) -> None:
    given = [name for name, value in sources.items() if value not in (None, False)]
    if len(given) != 1:
        found = f"got {', '.join(given)}" if given else "got none"
        raise ValueError(f"{what} needs exactly one of {', '.join(sources)} ({found})")


class VolumeSpec(_Strict):
    """A volume mounted into the trainer's container: a PVC, a hostPath or an emptyDir."""

    name: str = Field(description="volume name (RFC 1123 label)")
    mount_path: str = Field(description="absolute path inside the container")
    read_only: bool = False
    pvc: str | None = Field(None, description="PersistentVolumeClaim name in the site's namespace")
    host_path: str | None = Field(None, description="directory on the node")
    empty_dir: bool = Field(False, description="a scratch directory that lives as long as the pod")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value in (STORE_VOLUME, SCRATCH_VOLUME):
            raise ValueError(f"volume name {value!r} is reserved for flare-airflow's own volumes; choose another name")
        return _dns_label(value, "volume name")

    @field_validator("mount_path")
    @classmethod
    def _mount(cls, value: str) -> str:
        return _mount_path(value, "mount_path")

    @field_validator("host_path")
    @classmethod
    def _host(cls, value: str | None) -> str | None:
        return None if value is None else _host_path(value, "host_path")

    @field_validator("pvc")
    @classmethod
    def _pvc(cls, value: str | None) -> str | None:
        return None if value is None else _dns_subdomain(value, "claim name")

    @model_validator(mode="after")
    def _one_source(self) -> VolumeSpec:
        _exactly_one(f"volume {self.name!r}", pvc=self.pvc, host_path=self.host_path, empty_dir=self.empty_dir)
        return self


class StoreMount(_Strict):
    """How a pod reaches a file:// model store: the store root is mounted at ``mount_path``."""

    mount_path: str = Field("/flare-store", description="where the store root appears inside the container")
    pvc: str | None = Field(None, description="PersistentVolumeClaim holding the store root")
    host_path: str | None = Field(None, description="the store root's directory on the node")

    @field_validator("mount_path")
    @classmethod
    def _mount(cls, value: str) -> str:
        return _mount_path(value, "mount_path")

    @field_validator("host_path")
    @classmethod
    def _host(cls, value: str | None) -> str | None:
        return None if value is None else _host_path(value, "host_path")

    @field_validator("pvc")
    @classmethod
    def _pvc(cls, value: str | None) -> str | None:
        return None if value is None else _dns_subdomain(value, "claim name")

    @model_validator(mode="after")
    def _one_source(self) -> StoreMount:
        _exactly_one("store_mount", pvc=self.pvc, host_path=self.host_path)
        return self


_TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
_TOLERATION_OPERATORS = ("Exists", "Equal")
_TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _toleration(item: Any, index: int) -> dict[str, Any]:
    where = f"toleration {index}"
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} must be a mapping with keys {', '.join(_TOLERATION_KEYS)}, got {item!r}")
    unknown = [k for k in item if k not in _TOLERATION_KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(_TOLERATION_KEYS)}")
    out = dict(item)
    operator = out.get("operator", "Equal")
    if operator not in _TOLERATION_OPERATORS:
        raise ValueError(f"{where}: operator {operator!r} is not one of {', '.join(_TOLERATION_OPERATORS)}")
    for name in ("key", "value"):
        if name in out and not isinstance(out[name], str):
            raise ValueError(f"{where}: {name} must be a string, got {out[name]!r}")
    if "key" in out:
        _qualified_name(out["key"], f"{where}: key")
    elif operator != "Exists":
        raise ValueError(f"{where}: a toleration without a key must have operator Exists (it tolerates every taint)")
    if operator == "Exists" and out.get("value"):
        raise ValueError(f"{where}: operator Exists takes no value")
    if "value" in out:
        _label_value(out["value"], f"{where}: value")
    effect = out.get("effect")
    if effect is not None and effect not in _TOLERATION_EFFECTS:
        raise ValueError(f"{where}: effect {effect!r} is not one of {', '.join(_TOLERATION_EFFECTS)}")
    seconds = out.get("tolerationSeconds")
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, int):
            raise ValueError(f"{where}: tolerationSeconds must be an integer, got {seconds!r}")
        if effect != "NoExecute":
            raise ValueError(f"{where}: tolerationSeconds applies only to effect NoExecute")
    return out


_SYSTEM_NAMESPACES = ("kube-system", "kube-public", "kube-node-lease")
_MAX_SECONDS = 30 * 24 * 3600
# The image reference grammar of the OCI distribution spec (github.com/distribution/reference).
_IMAGE_DOMAIN = re.compile(
    r"^(localhost|(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*)(?::[0-9]+)?$"
)
_IMAGE_PATH = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_IMAGE_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_IMAGE_DIGEST = re.compile(r"^(sha256:[0-9a-f]{64}|sha384:[0-9a-f]{96}|sha512:[0-9a-f]{128})$")
_IMAGE_FORM = "[registry[:port]/]name[:tag][@sha256:<64 hex digits>], e.g. registry.example.org/fl/trainer:1.0"


def _image_reference(value: str) -> str:
    """An image reference the kubelet can pull (refused here rather than as InvalidImageName in a pod)."""

    def bad(why: str) -> ValueError:
        return ValueError(f"image {value!r} is not a valid image reference: {why}; use {_IMAGE_FORM}")

    if not value or any(c.isspace() or ord(c) < 32 for c in value):
        raise bad("it is empty or contains spaces")
    name, at, digest = value.partition("@")
    if at and not _IMAGE_DIGEST.match(digest):
        raise bad(f"digest {digest!r} must be sha256: followed by 64 lowercase hex digits")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _IMAGE_TAG.match(tag):
            raise bad(f"tag {tag!r} must be up to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'")
    parts = name.split("/")
    # As docker does: the first part names a registry only if it has a '.' or ':' or is localhost.
    if len(parts) > 1 and (parts[0] == "localhost" or "." in parts[0] or ":" in parts[0]):
        domain, parts = parts[0], parts[1:]
        if not _IMAGE_DOMAIN.match(domain):
            raise bad(f"registry {domain!r} must be a host name with an optional :port")
    repository = "/".join(parts)
    if repository != repository.lower() and all(_IMAGE_PATH.match(part.lower()) for part in parts):
        raise bad(f"the repository {repository!r} must be lowercase ({repository.lower()!r})")
    if not all(_IMAGE_PATH.match(part) for part in parts):
        raise bad(
            f"the repository {repository!r} must be lowercase letters and digits, separated by '.', '_', '__', "
            "'-' or '/'"
        )
    if len(name) > 255:
        raise bad("the name is longer than 255 characters")
    return value


class KubernetesLaunchSpec(_Strict):
    """Site policy for Kubernetes site jobs (``launcher_spec.k8s``): one pod per site job and round.

    The pod manifest is built from this block by ``flare_airflow.launchers.kubernetes.build_pod``.
    Secrets are references only (``secret_env``); their values never appear in a job or a pod spec.
    """

    image: str | None = Field(None, description="the site's trainer image (required for a k8s site)")
    namespace: str = Field("default", description="namespace the site's pods run in")
    kubernetes_conn_id: str | None = Field(
        None, description="Airflow connection of the site's cluster; None: in-cluster or kubeconfig default"
    )
    in_cluster: bool | None = Field(None, description="use the in-cluster service account configuration")
    config_file: str | None = Field(None, description="kubeconfig file (outside Airflow connections)")
    cluster_context: str | None = Field(None, description="kubeconfig context")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secrets with registry credentials")
    service_account_name: str | None = Field(None, description="the pod's service account; none: no API token")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict, description="plain environment values (never secrets)")
    secret_env: dict[str, SecretRef] = Field(
        default_factory=dict, description="environment from Secrets: NAME: {secret: <Secret>, key: <key>}"
    )
    volumes: list[VolumeSpec] = Field(default_factory=list)
    store_mount: StoreMount | None = Field(None, description="mount of a file:// model store into the pod")
    trainer_command: list[str] | None = Field(None, description="the trainer's command in the image; default python")
    trainer_script: str | None = Field(
        None, description="the trainer script's path in the image; default trainer.script as given"
    )
    pending_timeout: float = Field(300.0, gt=0, description="seconds Pending for lack of cpu / memory / GPUs")
    startup_timeout: float = Field(120.0, gt=0, description="seconds Pending for any other reason")
    keep_pods: bool = Field(False, description="keep finished pods (debugging)")
    poll_interval: float = Field(2.0, gt=0, description="seconds between pod status reads")

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        return None if value is None else _image_reference(value)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if value in _SYSTEM_NAMESPACES:
            raise ValueError(
                f"namespace {value!r} belongs to Kubernetes itself; run site jobs in a namespace of their own"
            )
        return _dns_label(value, "namespace")

    @field_validator("pending_timeout", "startup_timeout", "poll_interval", mode="before")
    @classmethod
    def _seconds(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) or (isinstance(value, int | float) and not 0 < value <= _MAX_SECONDS):
            raise ValueError(
                f"{info.field_name} must be a number of seconds > 0 and <= {_MAX_SECONDS} (30 days), got {value!r}"
            )
        return value

    @field_validator("kubernetes_conn_id", "config_file", "cluster_context", "trainer_script")
    @classmethod
    def _non_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it out for the default)")
        return value

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: list[str]) -> list[str]:
        return [_dns_subdomain(v, "image pull secret") for v in value]

    @field_validator("service_account_name")
    @classmethod
    def _service_account(cls, value: str | None) -> str | None:
        return None if value is None else _dns_subdomain(value, "service account name")

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            _qualified_name(key, "node_selector key")
            _label_value(item, f"node_selector[{key}]")
        return value

    @field_validator("tolerations", mode="before")
    @classmethod
    def _tolerations(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return [_toleration(item, i) for i, item in enumerate(value)]

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            _qualified_name(key, "label key")
            _label_value(item, f"label {key}")
            if key.startswith(RESERVED_LABEL_PREFIX) or key == MANAGED_BY_LABEL:
                raise ValueError(
                    f"label {key!r} is set by flare-airflow (job, run, round, site, try); choose another key"
                )
        return value

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            _qualified_name(key, "annotation key")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            _env_name(name, "env")
        return value

    @field_validator("secret_env", mode="before")
    @classmethod
    def _secret_references(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            for name, ref in value.items():
                if not isinstance(ref, Mapping | SecretRef):
                    raise ValueError(
                        f"secret_env.{name} must be a reference {{secret: <Secret name>, key: <key>}}, "
                        "never the value itself (values stay in the site's Kubernetes Secrets)"
                    )
        return value

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, value: dict[str, SecretRef]) -> dict[str, SecretRef]:
        for name in value:
            _env_name(name, "secret_env")
        return value

    @field_validator("trainer_command", mode="before")
    @classmethod
    def _command(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty (leave it out for the default ['python'])")
        return _argv(value)

    @model_validator(mode="after")
    def _consistent(self) -> KubernetesLaunchSpec:
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"{', '.join(both)} set in both env and secret_env; keep one")
        if self.in_cluster and self.config_file:
            raise ValueError("in_cluster and config_file exclude each other")
        names = [v.name for v in self.volumes]
        paths = [v.mount_path for v in self.volumes]
        if self.store_mount is not None:
            paths.append(self.store_mount.mount_path)
        for what, items in (("volume name", names), ("mount_path", paths)):
            dupes = sorted({i for i in items if items.count(i) > 1})
            if dupes:
                raise ValueError(f"{what} {dupes[0]!r} is used twice (volumes and store_mount)")
        store = self.store_mount
        if store is not None:
            for vol in self.volumes:
                # The pod sees only its round's input (read-only) and its own output of the store;
                # a volume over, under or of the store would hand it the rest.
                if _within(vol.mount_path, store.mount_path) or _within(store.mount_path, vol.mount_path):
                    raise ValueError(
                        f"volume {vol.name!r}: mount_path {vol.mount_path} overlaps store_mount.mount_path "
                        f"{store.mount_path}; mount it elsewhere"
                    )
                if (vol.pvc is not None and vol.pvc == store.pvc) or (
                    vol.host_path is not None
                    and store.host_path is not None
                    and (_within(vol.host_path, store.host_path) or _within(store.host_path, vol.host_path))
                ):
                    raise ValueError(
                        f"volume {vol.name!r} mounts the model store (or part of it) again; the pod gets the store "
                        "only through store_mount, which mounts just what the site job needs"
                    )
        return self


class LauncherSpec(_Strict):
    """Per-backend launcher blocks. Only the block of the site's backend is used."""

    process: ProcessLaunchSpec = Field(default_factory=ProcessLaunchSpec)
    k8s: KubernetesLaunchSpec = Field(default_factory=KubernetesLaunchSpec)
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
    def _k8s_image(self) -> SiteSpec:
        if self.launcher == "k8s" and self.launcher_spec.k8s.image is None:
            raise ValueError(
                "a Kubernetes site needs its trainer image: set launcher_spec.k8s.image "
                "(e.g. registry.example.org/fl/trainer:1.0, built from docker/Dockerfile.trainer)"
            )
        return self

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
        return _argv(value)


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
        elif origin is list:
            current = args[0]
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


class _UniqueKeyLoader(_SafeLoader):
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
