"""Site policy of Kubernetes sites (``launcher_spec.k8s``): image, namespace, scheduling, env, secrets."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from flare_airflow.core.config.slurm import DISTRIBUTED_ENV
from flare_airflow.core.config.validators import (
    RESERVED_ENV_PREFIX,
    Strict,
    argv,
    dns_label,
    dns_subdomain,
    env_or_secret,
    env_values,
    label_value,
    not_blank,
    positive_seconds,
    qualified_name,
    secret_env_names,
    secret_references,
)
from flare_airflow.core.config.volumes import StoreMount, VolumeSpec, path_within

# Labels the pod builder sets itself (flare_airflow.launchers.kubernetes.pod_labels).
RESERVED_LABEL_PREFIX = "flare-airflow/"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+\Z")


class SecretRef(Strict):
    """A key of a Kubernetes Secret in the site's namespace; the value never appears in a spec."""

    secret: str = Field(description="name of the Secret")
    key: str = Field(description="key inside the Secret")

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: str) -> str:
        return dns_subdomain(value, "secret name")

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if not _SECRET_KEY.match(value) or len(value) > 253:
            raise ValueError(f"secret key {value!r} may contain only letters, digits, '-', '_' and '.'")
        return value


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
        qualified_name(out["key"], f"{where}: key")
    elif operator != "Exists":
        raise ValueError(f"{where}: a toleration without a key must have operator Exists (it tolerates every taint)")
    if operator == "Exists" and out.get("value"):
        raise ValueError(f"{where}: operator Exists takes no value")
    if "value" in out:
        label_value(out["value"], f"{where}: value")
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
    r"^(localhost|(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*)(?::[0-9]+)?\Z"
)
_IMAGE_PATH = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*\Z")
_IMAGE_TAG = re.compile(r"^[\w][\w.-]{0,127}\Z")
_IMAGE_DIGEST = re.compile(r"^(sha256:[0-9a-f]{64}|sha384:[0-9a-f]{96}|sha512:[0-9a-f]{128})\Z")
_IMAGE_FORM = "[registry[:port]/]name[:tag][@sha256:<64 hex digits>], e.g. registry.example.org/fl/trainer:1.0"


def image_reference(value: str) -> str:
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


class KubernetesLaunchSpec(Strict):
    """Site policy for Kubernetes site jobs (``launcher_spec.k8s``): one pod per site job and round,
    or with ``nodes: N`` one pod per node plus a headless Service through which they find rank 0.

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
    nodes: int = Field(
        1,
        ge=1,
        le=1024,
        description="pods per site job, one per node; > 1: torchrun's variables and a headless Service",
    )
    master_port: int = Field(29500, ge=1024, le=65535, description="rank 0's rendezvous port (nodes > 1)")
    poll_interval: float = Field(2.0, gt=0, description="seconds between pod status reads")

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        return None if value is None else image_reference(value)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if value in _SYSTEM_NAMESPACES:
            raise ValueError(
                f"namespace {value!r} belongs to Kubernetes itself; run site jobs in a namespace of their own"
            )
        return dns_label(value, "namespace")

    @field_validator("pending_timeout", "startup_timeout", "poll_interval", mode="before")
    @classmethod
    def _seconds(cls, value: Any, info: ValidationInfo) -> Any:
        return positive_seconds(value, str(info.field_name))

    @field_validator("kubernetes_conn_id", "config_file", "cluster_context", "trainer_script")
    @classmethod
    def _non_empty(cls, value: str | None, info: ValidationInfo) -> str | None:
        blank = "must not be empty (leave it out for the default)"
        return None if value is None else not_blank(value, str(info.field_name), blank)

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: list[str]) -> list[str]:
        return [dns_subdomain(v, "image pull secret") for v in value]

    @field_validator("service_account_name")
    @classmethod
    def _service_account(cls, value: str | None) -> str | None:
        return None if value is None else dns_subdomain(value, "service account name")

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            qualified_name(key, "node_selector key")
            label_value(item, f"node_selector[{key}]")
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
            qualified_name(key, "label key")
            label_value(item, f"label {key}")
            if key.startswith(RESERVED_LABEL_PREFIX) or key == MANAGED_BY_LABEL:
                raise ValueError(
                    f"label {key!r} is set by flare-airflow (job, run, round, site, try); choose another key"
                )
        return value

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            qualified_name(key, "annotation key")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return env_values(value, (RESERVED_ENV_PREFIX,))

    @field_validator("secret_env", mode="before")
    @classmethod
    def _secret_references(cls, value: Any) -> Any:
        return secret_references(
            value, SecretRef, "{secret: <Secret name>, key: <key>}", "the site's Kubernetes Secrets"
        )

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, value: dict[str, SecretRef]) -> dict[str, SecretRef]:
        return secret_env_names(value, (RESERVED_ENV_PREFIX,))

    @field_validator("trainer_command", mode="before")
    @classmethod
    def _command(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty (leave it out for the default ['python'])")
        return argv(value)

    @model_validator(mode="after")
    def _consistent(self) -> KubernetesLaunchSpec:
        env_or_secret(self.env, self.secret_env)
        for name in (*self.env, *self.secret_env):
            if name in DISTRIBUTED_ENV:
                raise ValueError(
                    f"{name} is set by flare-airflow for each pod of a multi-node site job (RANK, WORLD_SIZE, "
                    "LOCAL_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT); choose another name"
                )
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
