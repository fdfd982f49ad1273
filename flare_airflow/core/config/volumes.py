"""Volumes of Kubernetes site pods: the site's own (``volumes``) and the model store's (``store_mount``).

Paths are checked here so that no pod mounts the node's system directories or shadows the image's.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from flare_airflow.core.config.validators import Strict, dns_label, dns_subdomain, exactly_one

STORE_VOLUME = "flare-store"
SCRATCH_VOLUME = "flare-scratch"


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
# of them or above one of them (e.g. /var, which holds /var/run) is refused; the first group is
# also the image's own system directories, which no volume may shadow.
_SYSTEM_DIRS = ("/etc", "/proc", "/sys", "/dev", "/boot", "/root", "/usr", "/bin", "/sbin", "/lib", "/run", "/var/run")
SYSTEM_HOST_PATHS = (
    *_SYSTEM_DIRS,
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
SYSTEM_MOUNT_PATHS = (*_SYSTEM_DIRS, "/var/lib")
# The pod's writable scratch directory (an emptyDir; the root filesystem is read-only).
SCRATCH_PATH = "/tmp"  # noqa: S108 - a pod's own emptyDir, not the host's /tmp
_LIB_DIR = re.compile(r"^/lib[^/]*(/|\Z)")  # /lib, /lib32, /lib64, /libx32 ...


def _system_dir(path: str, system: tuple[str, ...]) -> str | None:
    """The system directory ``path`` is in, is, or contains; ``None`` if it stays clear of all of them."""
    if path == "/":
        return "/"
    if _LIB_DIR.match(path):
        return "/" + path.split("/")[1]
    return next((top for top in system if path_within(path, top) or path_within(top, path)), None)


def host_directory(value: str, what: str) -> str:
    path = _absolute_path(value, what)
    system = _system_dir(path, SYSTEM_HOST_PATHS)
    if system is not None:
        where = "the node's root" if system == "/" else f"the node's system directory {system}"
        raise ValueError(
            f"{what} {value!r} would expose {where} to the trainer: mount a data directory of its own (or use a PVC)"
        )
    return path


def mount_directory(value: str, what: str) -> str:
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


class _Mounted(Strict):
    """The checks of what a pod mounts (a volume, the store): its path, and where it comes from.

    Subclasses declare the fields (``mount_path``, ``pvc``, ``host_path``) in their own order.
    """

    @field_validator("mount_path", check_fields=False)
    @classmethod
    def _mount(cls, value: str) -> str:
        return mount_directory(value, "mount_path")

    @field_validator("host_path", check_fields=False)
    @classmethod
    def _host(cls, value: str | None) -> str | None:
        return None if value is None else host_directory(value, "host_path")

    @field_validator("pvc", check_fields=False)
    @classmethod
    def _pvc(cls, value: str | None) -> str | None:
        return None if value is None else dns_subdomain(value, "claim name")


class VolumeSpec(_Mounted):
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
        return dns_label(value, "volume name")

    @model_validator(mode="after")
    def _one_source(self) -> VolumeSpec:
        exactly_one(f"volume {self.name!r}", pvc=self.pvc, host_path=self.host_path, empty_dir=self.empty_dir)
        return self


class StoreMount(_Mounted):
    """How a pod reaches a file:// model store: the store root is mounted at ``mount_path``."""

    mount_path: str = Field("/flare-store", description="where the store root appears inside the container")
    pvc: str | None = Field(None, description="PersistentVolumeClaim holding the store root")
    host_path: str | None = Field(None, description="the store root's directory on the node")

    @model_validator(mode="after")
    def _one_source(self) -> StoreMount:
        exactly_one("store_mount", pvc=self.pvc, host_path=self.host_path)
        return self

    @property
    def worker_path(self) -> str:
        """Where the site's worker sees this folder: the host path (the worker runs on a node that
        has it), or the PVC's ``mount_path`` (the worker mounts the PVC at the same path)."""
        return self.host_path or self.mount_path
