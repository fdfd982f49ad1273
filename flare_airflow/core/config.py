"""Job configuration: one validated model for YAML and Python jobs.

A job names its trainer, its rounds, its quorum and its sites. Sites follow NVIDIA FLARE's job
meta: a ``@default`` site entry, ``resource_spec`` (``num_of_gpus``, ``num_of_cpus``, ``memory``)
and ``launcher_spec`` blocks per backend. Blocks merge shallowly, most specific last::

    top-level launcher_spec.default  <  sites.@default  <  top-level launcher_spec.<site>  <  sites.<site>

Every error names the file, the field and the site, and says what is allowed.
"""

from __future__ import annotations

import math
import pathlib
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from flare_airflow.core.errors import ConfigError, FlareAirflowError

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
_HPARAM_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
# Airflow's own schedule presets beyond cron's (airflow.sdk.definitions.dag._create_timetable).
_SCHEDULE_PRESETS = ("@once", "@continuous")
_CRON_PRESETS = {"@quarterly": "0 0 1 */3 *"}
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# Labels the pod builder sets itself (flare_airflow.launchers.kubernetes.pod_labels).
RESERVED_LABEL_PREFIX = "flare-airflow/"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# Names of the Client API's variables (and of what the launcher adds) belong to flare-airflow.
RESERVED_ENV_PREFIX = "FLARE_"
# A process trainer inherits the worker's environment minus Airflow's own variables
# (flare_airflow.launchers.process): a job may not put them back.
RESERVED_PROCESS_ENV_PREFIXES = (RESERVED_ENV_PREFIX, "AIRFLOW", "_AIRFLOW")
STORE_VOLUME = "flare-store"
SCRATCH_VOLUME = "flare-scratch"
Scalar = int | float | str | bool
# Store URI schemes a run can use: the local file system and the object stores Airflow's
# ObjectStoragePath reaches through fsspec (the backend package must be installed where tasks run).
STORE_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs", "webhdfs", "sftp")
# Upper bounds: beyond them a value is a typo, and some would overflow (timedelta, pool slots).
MAX_SECONDS = 366 * 24 * 3600.0
MAX_WEIGHT = 1e6
MIN_WEIGHT = 1e-6
# Integers the trigger form (JSON in a browser) carries exactly.
MAX_FORM_INT = 2**53
# A job file is small (a 1024-site job is ~60 KiB); YAML aliases may not expand it without bound.
MAX_JOB_FILE_BYTES = 4 * 1024 * 1024
MAX_EXPANDED_NODES = 200_000
MAX_NESTING = 64
MAX_REPR = 80


def short_repr(value: Any, limit: int = MAX_REPR) -> str:
    """``repr(value)`` cut to ``limit`` characters: messages stay readable whatever the input."""
    try:
        text = reprlib_repr(value)
    except Exception:  # an object whose repr fails is still named by its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clip(text: str, limit: int = MAX_REPR) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reprlib_repr(value: Any) -> str:
    # reprlib bounds the work on huge or deeply nested values (an alias bomb expands to 10**9 items).
    r = reprlib.Repr()
    r.maxstring = r.maxother = MAX_REPR
    r.maxlist = r.maxdict = r.maxtuple = r.maxset = 6
    r.maxlevel = 3
    return r.repr(value)


class _Strict(BaseModel):
    # strict: no silent coercion (`rounds: true` is not 1, `evaluate: "no"` is not True);
    # allow_inf_nan=False: `.inf` / `.nan` are no timeout, weight or CPU count.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ResourceSpec(_Strict):
    """What one site job asks for (NVFlare ``resource_spec``)."""

    num_of_gpus: int = Field(0, ge=0, le=1024, description="GPUs per site job")
    num_of_cpus: float | None = Field(None, gt=0, le=4096, description="CPU cores per site job")
    memory: str | None = Field(None, description="memory per site job, e.g. '4Gi'")
    mem_per_gpu_in_GiB: float | None = Field(None, ge=0, le=1e6, description="free GPU memory needed per GPU")

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError(f"must be a quantity like '512Mi', '4Gi' or '2G', got {short_repr(value)}")
        text = str(value)
        match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([EPTGMK]i?|[eE][0-9]+)?", text)
        if not match:
            raise ValueError(f"{short_repr(text)} is not a quantity like '512Mi', '4Gi' or '2G'")
        if _quantity_bytes(match.group(1), match.group(2) or "") < 1:
            raise ValueError(f"{text!r} is less than one byte: give the memory a site job needs, e.g. '4Gi'")
        if _quantity_bytes(match.group(1), match.group(2) or "") > 2**63 - 1:
            raise ValueError(f"{short_repr(text)} is more memory than any machine has (at most 8Ei)")
        return text


_QUANTITY_SUFFIXES = {
    "": 1,
    **{s: 1000**i for i, s in enumerate("KMGTPE", start=1)},
    **{s + "i": 1024**i for i, s in enumerate("KMGTPE", start=1)},
}


def _quantity_bytes(number: str, suffix: str) -> float:
    if suffix[:1] in ("e", "E") and suffix[1:].isdigit():
        exponent = int(suffix[1:])
        return math.inf if exponent > 30 else float(number) * 10.0**exponent
    return float(number) * _QUANTITY_SUFFIXES[suffix]


CONNECTION_FIELDS = ("password", "login", "host", "schema", "port", "uri")


class AirflowSecretRef(_Strict):
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
        _exactly_one("a secret reference", conn_id=self.conn_id, variable=self.variable)
        if self.variable is not None and "field" in self.model_fields_set:
            raise ValueError("field applies to conn_id only (a variable has one value)")
        return self

    def describe(self) -> str:
        return f"Airflow variable {self.variable!r}" if self.variable else f"connection {self.conn_id!r} {self.field}"


class ProcessLaunchSpec(_Strict):
    """Site policy for local-process site jobs."""

    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the trainer")
    secret_env: dict[str, AirflowSecretRef] = Field(
        default_factory=dict,
        description="environment from Airflow: NAME: {conn_id: <id>, field: password} or {variable: <key>}",
    )
    cwd: str | None = Field(None, description="working directory of the trainer")

    @field_validator("secret_env", mode="before")
    @classmethod
    def _secret_references(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            for name, ref in value.items():
                if not isinstance(ref, Mapping | AirflowSecretRef):
                    raise ValueError(
                        f"secret_env.{name} must be a reference {{conn_id: <connection>, field: <field>}} or "
                        "{variable: <key>}, never the value itself (values stay in Airflow connections/variables)"
                    )
        return value

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, value: dict[str, AirflowSecretRef]) -> dict[str, AirflowSecretRef]:
        for name in value:
            _env_name(name, "secret_env", reserved=RESERVED_PROCESS_ENV_PREFIXES)
        return value

    @model_validator(mode="after")
    def _env_or_secret(self) -> ProcessLaunchSpec:
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"{', '.join(both)} set in both env and secret_env; keep one")
        return self

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, item in value.items():
            _env_name(name, "env", reserved=RESERVED_PROCESS_ENV_PREFIXES)
            _no_nul(item, f"env.{name}")
        return value

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it out to run in the job file's directory)")
        return None if value is None else _no_nul(value, "cwd")


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


def _no_nul(value: str, what: str) -> str:
    # execve and the file system cut a string at NUL: what ran would differ from what was written.
    if "\0" in value:
        raise ValueError(f"{what} contains a NUL character (\\0), which no argument, path or variable may hold")
    return value


def _argv(value: Any) -> Any:
    """An exact argv: a list of strings (numbers are turned into strings), never one shell string."""
    if isinstance(value, str):
        raise ValueError("must be a list of arguments, not a string (arguments are never run through a shell)")
    if isinstance(value, list | tuple):
        out = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, str | int | float):
                raise ValueError(f"argument {short_repr(item)} must be a string or a number")
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"argument {item!r} is not a finite number; quote it if you mean the text")
            out.append(_no_nul(str(item), f"argument {short_repr(item)}"))
        return out
    return value


def _env_name(name: str, what: str, reserved: tuple[str, ...] = (RESERVED_ENV_PREFIX,)) -> str:
    if not _ENV_NAME.match(name):
        raise ValueError(
            f"{what}: {short_repr(name)} is not a valid environment variable name "
            "(letters, digits, '_', '-', '.'; not starting with a digit; no '=')"
        )
    if name.startswith(reserved):
        airflow = ", AIRFLOW* ones are Airflow's own" if len(reserved) > 1 else ""
        raise ValueError(
            f"{what}: {name!r} is reserved ({', '.join(p + '*' for p in reserved)}): FLARE_* variables are set by "
            f"flare-airflow for the Client API{airflow}; choose another name"
        )
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


def path_within(path: str, top: str) -> bool:
    """Whether ``path`` is ``top`` or lies under it (both normalised absolute paths)."""
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
    return next((top for top in system if path_within(path, top) or path_within(top, path)), None)


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
        if isinstance(value, bool) or (isinstance(value, int | float) and not 0 < value <= MAX_SECONDS):
            raise ValueError(
                f"{info.field_name} must be a number of seconds > 0 and <= {int(MAX_SECONDS)} (366 days), got {value!r}"
            )
        return value

    @field_validator("kubernetes_conn_id", "config_file", "cluster_context", "trainer_script")
    @classmethod
    def _non_empty(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it out for the default)")
        return None if value is None else _no_nul(value, str(info.field_name))

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
        for name, item in value.items():
            _env_name(name, "env")
            _no_nul(item, f"env.{name}")
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
                if path_within(vol.mount_path, store.mount_path) or path_within(store.mount_path, vol.mount_path):
                    raise ValueError(
                        f"volume {vol.name!r}: mount_path {vol.mount_path} overlaps store_mount.mount_path "
                        f"{store.mount_path}; mount it elsewhere"
                    )
                if (vol.pvc is not None and vol.pvc == store.pvc) or (
                    vol.host_path is not None
                    and store.host_path is not None
                    and (path_within(vol.host_path, store.host_path) or path_within(store.host_path, vol.host_path))
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
    num_of_gpus: int = Field(0, ge=0, le=4096, description="GPUs the site has (pool slots)")
    gpu_class: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,30}$", description="e.g. 'a100'")
    pool: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,256}$", description="Airflow pool name")
    ignore_host: bool = Field(False, description="do not assign local devices (jobs run on other machines)")


class SiteSpec(_Strict):
    """One site of a job, after ``@default`` has been merged in."""

    launcher: Literal["process", "k8s", "docker", "slurm"] = "process"
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT, description="multiplies num_samples in FedAvg")
    retries: int = Field(0, ge=0, le=20)
    retry_delay_seconds: float = Field(10.0, ge=0, le=MAX_SECONDS)
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
        None, gt=0, le=MAX_SECONDS, description="seconds for the trainer to call receive(); unlimited by default"
    )
    shutdown_timeout: float = Field(10.0, ge=0, le=3600, description="grace between SIGTERM and SIGKILL")
    timeout: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="seconds a site job may run (execution timeout)"
    )

    @field_validator("args", "command", mode="before")
    @classmethod
    def _argv(cls, value: Any) -> Any:
        return _argv(value)

    @field_validator("script")
    @classmethod
    def _script(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name the trainer script, e.g. 'train.py' (relative to the job file)")
        return _no_nul(value, "trainer.script")

    @field_validator("hparams", mode="before")
    @classmethod
    def _hparams(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        for key, item in value.items():
            if not isinstance(key, str) or not _HPARAM_KEY.match(key):
                raise ValueError(
                    f"hyper-parameter name {short_repr(key)} is not allowed: use letters, digits and '_', "
                    "starting with a letter (it becomes the trigger form field hp_<name>)"
                )
            what = f"hyper-parameter {key!r}"
            if isinstance(item, str):
                _no_nul(item, what)
                continue
            if isinstance(item, bool):
                continue
            if isinstance(item, int):
                if abs(item) > MAX_FORM_INT:
                    raise ValueError(f"{what} is {short_repr(item)}: integers must be within +-2**53 (the form's JSON)")
            elif isinstance(item, float):
                if not math.isfinite(item):
                    raise ValueError(f"{what} is {item!r}: hyper-parameters must be finite numbers")
            else:
                raise ValueError(
                    f"{what} must be a number, a string or true/false, got {type(item).__name__} "
                    f"{short_repr(item)} (the trigger form has one field per hyper-parameter)"
                )
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

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str | None) -> str | None:
        if value is None or value in _SCHEDULE_PRESETS:
            return value
        _no_nul(value, "schedule")
        try:
            # Airflow's own cron parser; imported here only (core does not import Airflow).
            from croniter import croniter
        except ImportError:  # pragma: no cover - croniter comes with Airflow
            return value
        try:
            croniter(_CRON_PRESETS.get(value, value))
        except Exception as exc:  # croniter's errors have no common base beyond ValueError/KeyError
            raise ValueError(
                f"schedule {short_repr(value)} is not a cron expression ({_clip(str(exc), 120)}): use five "
                "fields like '0 3 * * 1' (Mondays 03:00), a preset (@hourly, @daily, @weekly, @monthly, "
                "@quarterly, @yearly, @once, @continuous), or leave it out for manual runs"
            ) from None
        return value

    @field_validator("store")
    @classmethod
    def _store(cls, value: str | None) -> str | None:
        if value is None:
            return None
        _no_nul(value, "store")
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

    @field_validator("initial_model", "base_dir")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name a file (paths are relative to the job file)")
        return _no_nul(value, "path")

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
            what = "is not a file" if self.initial_model_path().exists() else "does not exist"
            raise ValueError(
                f"initial_model {self.initial_model!r} {what} (looked at {self.initial_model_path()}); "
                "give a safetensors file, relative to the job file"
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
        backend = BACKEND_ALIASES.get(key, key) if isinstance(key, str) else key
        if backend not in BACKENDS:
            raise ValueError(
                f"{where}: unknown launcher backend {short_repr(key)}; allowed: {', '.join(BACKENDS)}, kubernetes"
            )
        out[backend] = value
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
                known = _clip(", ".join(map(str, names)), 200)
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
            backend: _merge_block(
                *((layer[backend], f"{where}.{backend}") for layer, where in layers if backend in layer)
            )
            for backend in BACKENDS
            if any(backend in layer for layer, _ in layers)
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


_TYPE_MESSAGES = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number (not .inf or .nan)",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "model_type": "must be a mapping of keys to values",
    "model_attributes_type": "must be a mapping of keys to values",
    "dict_type": "must be a mapping of keys to values",
    "list_type": "must be a list",
    "invalid_key": "keys must be strings",
}
MAX_ERROR_LINES = 20
MAX_ERROR_LINE = 400


def _message(err: Any, loc: tuple[Any, ...]) -> str:
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        return f"unknown key {short_repr(loc[-1])}" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
    if kind == "missing":
        return "required field is missing"
    if kind in _TYPE_MESSAGES:
        msg = _TYPE_MESSAGES[kind]
        if isinstance(value, bool) and kind.startswith(("int", "float")):
            return f"{msg}, got {str(value).lower()} (true/false is not a number)"
        if kind == "string_type" and isinstance(value, int | float):
            return f"{msg}, got the number {short_repr(value)} (quote it: '{value}')"
        return f"{msg}, got {type(value).__name__} {short_repr(value)}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if msg.startswith("Input should be "):
        # pydantic's range and choice messages ("Input should be greater than 0") plus what was given
        msg = "must be " + msg.removeprefix("Input should be ") + f", got {short_repr(value)}"
    return msg


def _cap(line: str) -> str:
    if len(line) <= MAX_ERROR_LINE:
        return line
    # keep the head (where and what) and the tail (what to do); cut the middle (a long value)
    return line[: MAX_ERROR_LINE - 150] + " ... " + line[-145:]


def _describe(exc: ValidationError, source: str) -> str:
    lines = []
    errors = exc.errors()
    for err in errors[:MAX_ERROR_LINES]:
        loc = tuple(err["loc"])
        msg = _message(err, loc)
        if not loc:
            # raised before field validation (merging @default and NVFlare's blocks): names its block
            lines.append(_cap(f"{source}: {msg}"))
            continue
        field = ".".join(str(p) for p in loc)
        where = f"{source}: {short_repr(field, 200) if len(field) > 200 else field}"
        if len(loc) >= 2 and loc[0] == "sites":
            where += f" (site {short_repr(loc[1])})"
        lines.append(_cap(f"{where}: {msg}"))
    if len(errors) > MAX_ERROR_LINES:
        lines.append(f"... and {len(errors) - MAX_ERROR_LINES} more errors")
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
    except ValueError as exc:  # raised while merging sites, before field validation; names its block
        raise ConfigError(f"invalid job configuration:\n  {_cap(f'{source}: {exc}')}") from None


class _UniqueKeyLoader(_SafeLoader):
    """A safe loader that refuses duplicate keys, alias bombs and self-referencing documents.

    Aliases are fine (``&defaults`` ... ``*defaults``), but what they expand to is bounded: the
    composed node graph is measured before anything is constructed, so a 1 KiB file that would
    expand to 10**9 values is refused in microseconds.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        _expanded_size(node, {}, set(), 0)
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    "merge keys ('<<') are not supported: write the keys out "
                    "(settings every site shares go in sites.@default)",
                    key_node.start_mark,
                )
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a key is a list or mapping; keys must be plain names", key_node.start_mark
                ) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {short_repr(key)} (each key may appear once)", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int], depth: int) -> int:
    """Values ``node`` expands to with every alias followed (memoised: linear in the file)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise yaml.constructor.ConstructorError(
            None, None, "an alias refers to a value that contains it (a self-referencing document)", node.start_mark
        )
    if depth > MAX_NESTING:
        raise yaml.constructor.ConstructorError(
            None, None, f"values are nested more than {MAX_NESTING} levels deep", node.start_mark
        )
    size = 1
    if isinstance(node, yaml.SequenceNode | yaml.MappingNode):
        open_nodes.add(key)
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        for child in children:
            size += _expanded_size(child, sizes, open_nodes, depth + 1)
            if size > MAX_EXPANDED_NODES:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the document expands to more than {MAX_EXPANDED_NODES} values through its aliases "
                    "(an alias bomb?); write the values out or use fewer nested aliases",
                    node.start_mark,
                )
        open_nodes.discard(key)
    sizes[key] = size
    return size


def load_initial_model(job: JobConfig) -> dict[str, Any]:
    """The job's ``initial_model`` as tensors, checked as a run checks it (strict safetensors, finite).

    ``load_job`` only checks that the file exists (every task process parses the job); this reads
    it. Raises ``ConfigError`` naming the field, the file and what is wrong.
    """
    from flare_airflow.core.model import all_finite, parse_safetensors

    path = job.initial_model_path()
    where = f"initial_model {job.initial_model!r} ({path})"
    try:
        params = parse_safetensors(path.read_bytes(), str(path))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except FlareAirflowError as exc:
        raise ConfigError(f"{where}: {_clip(str(exc).removeprefix(f'{path}: '), 300)}") from None
    if not params:
        raise ConfigError(f"{where}: holds no tensors; save the model's initial weights (safetensors.numpy.save_file)")
    bad = all_finite(params)
    if bad is not None:
        raise ConfigError(f"{where}: tensor {bad!r} has NaN or infinite values; the first round would publish them")
    return params


def check_store_backend(job: JobConfig) -> None:
    """The store's URI scheme has its fsspec backend installed here (a run would fail without it)."""
    if not job.store or "://" not in job.store:
        return
    scheme = job.store.partition("://")[0]
    if scheme == "file":
        return
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ConfigError(
            f"store {job.store!r}: the {scheme}:// backend is not installed here ({_clip(str(exc), 160)}); "
            "install it (e.g. the matching Airflow provider) on every machine that runs tasks"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"store {job.store!r}: {_clip(str(exc), 160)}") from None


def _read_job_text(path: pathlib.Path) -> str:
    try:
        if path.is_dir():
            raise ConfigError(f"{path}: is a directory; give the job's YAML file (e.g. {path}/job.yaml)")
        with path.open("rb") as fh:
            raw = fh.read(MAX_JOB_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the job file ({exc.strerror or exc})") from None
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(f"{short_repr(str(path))}: not a usable file name ({exc})") from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise ConfigError(
            f"{path}: larger than {MAX_JOB_FILE_BYTES // 2**20} MiB; a job file holds settings, not data "
            "(is this the right file?)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a text file (byte {exc.start} is not UTF-8); a job file is YAML text: is this the right file?"
        ) from None


def load_job(path: str | pathlib.Path) -> JobConfig:
    """Load and validate a job YAML file; relative paths in it are relative to the file."""
    path = pathlib.Path(path)
    text = _read_job_text(path)
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(_cap(f"{where}: malformed YAML: {problem}")) from None
    except RecursionError:
        raise ConfigError(f"{path}: malformed YAML: values are nested too deeply") from None
    if data is None:
        raise ConfigError(f"{path}: the job file is empty; see docs/dag-authors.md for the keys a job needs")
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{path}: the job file must be a YAML mapping (job: ..., rounds: ..., sites: ...), "
            f"got a {type(data).__name__} {short_repr(data)}"
        )
    return job_from_dict(data, source=str(path), base_dir=str(path.parent.resolve()))
