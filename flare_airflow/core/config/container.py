"""Site policy of container sites (``launcher_spec.container``): podman or docker on the site's host.

Each site job runs the trainer image in one container with fixed security defaults the block
cannot loosen: a non-root user, a read-only root filesystem, ``--cap-drop ALL``,
``no-new-privileges``, no network unless the site allows one, only the round's input model
mounted (read-only) and the try's staging directory (read-write). The argv is built once, by
``flare_airflow.launchers.container.command``.
"""

from __future__ import annotations

import grp
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from flare_airflow.core.config.kubernetes import image_reference
from flare_airflow.core.config.process import AirflowEnvBlock, AirflowSecretRef
from flare_airflow.core.config.validators import (
    SITE_POLICY_CONTEXT,
    Strict,
    argv,
    env_or_secret,
    no_nul,
)
from flare_airflow.core.config.volumes import host_directory, mount_directory, path_within

# Keys of other engines' run options a site admin might reach for; each one would loosen the
# sandbox, so each is refused by name instead of as an unknown key.
_PRIVILEGED_KEYS = {
    "privileged": "a privileged container is root on the host",
    "cap_add": "capabilities are all dropped",
    "security_opt": "seccomp / SELinux / AppArmor options stay the engine's defaults",
    "user_ns": "the user namespace stays the engine's default",
    "pid": "the container has its own PID namespace",
    "ipc": "the container has its own IPC namespace",
    "devices": "GPUs are given as gpu_devices, nothing else",
}
_ROOT_USERS = ("0", "root")
_MAX_ID = 4294967294  # 2**32 - 2: (uid_t)-1 means "unchanged" to the kernel
# What a job file may pass as a GPU (issue 35): CDI names of GPU vendors, NVIDIA device nodes, DRM
# render/card nodes and AMD's KFD -- never a disk (/dev/vda), /dev/mem, /dev/kvm, nor a permission
# suffix (:rwm). Any other device only from the site policy, the site admin's.
_GPU_DEVICE = re.compile(
    r"(nvidia\.com|amd\.com|intel\.com)/gpu=[A-Za-z0-9_.-]+"
    r"|/dev/nvidia([0-9]+|ctl|-uvm|-uvm-tools|-modeset|-caps/nvidia-cap[0-9]+)"
    r"|/dev/dri/(renderD|card)[0-9]+|/dev/kfd"
)
# Groups that reach the host past a container (raw disks, kernel memory, password hashes, the
# engine's socket, admin rights): a job file's user may not name them; the site policy may.
_PRIVILEGED_GROUP_IDS = {0: "root", 4: "adm", 5: "tty", 6: "disk", 15: "kmem", 27: "sudo", 42: "shadow"}
_PRIVILEGED_GROUP_NAMES = ("root", "adm", "tty", "disk", "kmem", "sudo", "wheel", "shadow", "docker", "lxd", "libvirt",
                           "kvm", "systemd-journal")  # fmt: skip


class ContainerVolume(Strict):
    """A host directory the site mounts into its trainer containers (read-only unless said)."""

    host_path: str = Field(description="directory on the host; must lie under one of allowed_host_paths")
    mount_path: str = Field(description="absolute path inside the container")
    read_only: bool = True

    @field_validator("host_path")
    @classmethod
    def _host(cls, value: str) -> str:
        return host_directory(value, "host_path")

    @field_validator("mount_path")
    @classmethod
    def _mount(cls, value: str) -> str:
        return mount_directory(value, "mount_path")


class ContainerLaunchSpec(AirflowEnvBlock):
    """Site policy for container site jobs: one container per site job and round."""

    engine: Literal["podman", "docker"] = Field("podman", description="the container engine's command")
    image: str | None = Field(None, description="the site's trainer image (required for a container site)")
    pull: Literal["missing", "always", "never"] = Field(
        "missing", description="when the engine pulls the image (podman/docker --pull)"
    )
    user: str = Field("1000:1000", description="uid[:gid] the trainer runs as; never root")
    network: Literal["none", "bridge"] = Field(
        "none", description="none: no network at all (default); bridge: the engine's private network with egress"
    )
    env: dict[str, str] = Field(default_factory=dict, description="plain environment values (never secrets)")
    secret_env: dict[str, AirflowSecretRef] = Field(
        default_factory=dict,
        description="environment from Airflow, resolved on the worker: NAME: {conn_id: <id>} or {variable: <key>}",
    )
    trainer_command: list[str] | None = Field(None, description="the trainer's command in the image; default python")
    trainer_script: str | None = Field(
        None, description="the trainer script's path in the image; default trainer.script as given"
    )
    gpu_devices: list[str] = Field(
        default_factory=list,
        description="the host's GPUs as the engine names them (CDI: nvidia.com/gpu=0); a job gets num_of_gpus of them",
    )
    volumes: list[ContainerVolume] = Field(default_factory=list, description="site data directories")
    allowed_host_paths: list[str] = Field(
        default_factory=list, description="host directories volumes may come from (the site admin's list)"
    )
    pids_limit: int = Field(4096, ge=16, le=1 << 22, description="processes and threads inside the container")
    tmp_size: str = Field("1g", description="size of the container's writable /tmp (a tmpfs)")
    poll_interval: float = Field(1.0, gt=0, le=3600, description="seconds between container state reads")

    @model_validator(mode="before")
    @classmethod
    def _no_privileges(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in _PRIVILEGED_KEYS.items():
                if key in data:
                    raise ValueError(
                        f"{key}: container sites never loosen the sandbox ({why}); remove {key} -- "
                        "the container runs non-root, read-only, with no capabilities and no new privileges"
                    )
        return data

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        return None if value is None else image_reference(value)

    @field_validator("user")
    @classmethod
    def _user(cls, value: str, info: ValidationInfo) -> str:
        uid, _, gid = value.partition(":")
        if not uid.isdigit() or (gid and not gid.isdigit()):
            raise ValueError(f"user {value!r} must be a numeric uid or uid:gid, e.g. 1000:1000 (the image's trainer)")
        if uid in _ROOT_USERS or int(uid) == 0 or (gid and int(gid) == 0):
            raise ValueError(f"user {value!r} is root: container sites run the trainer as a non-root uid:gid")
        if int(uid) > _MAX_ID or (gid and int(gid) > _MAX_ID):
            raise ValueError(f"user {value!r}: uid and gid must be at most {_MAX_ID}")
        group = _privileged_group(int(gid)) if gid else None
        if group is not None and not _from_site_policy(info):
            raise ValueError(
                f"user {value!r}: gid {gid} is the host's group {group!r}, which reaches the host past the container; "
                "a job file may not name it (only the site policy may), use the image's own group, e.g. 1000:1000"
            )
        return value

    @field_validator("trainer_command", mode="before")
    @classmethod
    def _command(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty (leave it out for the default ['python'])")
        return argv(value)

    @field_validator("trainer_script")
    @classmethod
    def _script(cls, value: str | None) -> str | None:
        return None if value is None else no_nul(value, "trainer_script")

    @field_validator("gpu_devices")
    @classmethod
    def _gpus(cls, value: list[str], info: ValidationInfo) -> list[str]:
        for device in value:
            if not device or any(c.isspace() or ord(c) < 32 for c in device) or device.startswith("-"):
                raise ValueError(
                    f"gpu device {device!r} must be a device name such as nvidia.com/gpu=0 or /dev/nvidia0"
                )
            if not _from_site_policy(info) and not _GPU_DEVICE.fullmatch(device):
                raise ValueError(
                    f"gpu device {device!r} is not a GPU: a job file may pass only GPUs (CDI names such as "
                    "nvidia.com/gpu=0, /dev/nvidiaN, /dev/dri/renderDN, /dev/kfd; no ':rwm' suffix); any other "
                    "device only in the site policy (sites.<site>.launcher_spec.container.gpu_devices)"
                )
        if len(set(value)) != len(value):
            raise ValueError("gpu_devices lists a device twice")
        return value

    @field_validator("allowed_host_paths")
    @classmethod
    def _allowed(cls, value: list[str]) -> list[str]:
        return [host_directory(v, "allowed_host_paths") for v in value]

    @field_validator("tmp_size")
    @classmethod
    def _tmp_size(cls, value: str) -> str:
        number = value[:-1] if value[-1:].lower() in ("k", "m", "g") else value
        if not number.isdigit() or int(number) < 1:
            raise ValueError(f"tmp_size {value!r} must be a size such as 512m or 1g")
        return value

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> ContainerLaunchSpec:
        env_or_secret(self.env, self.secret_env)
        for volume in self.volumes:
            if not any(path_within(volume.host_path, top) for top in self.allowed_host_paths):
                allowed = ", ".join(self.allowed_host_paths) or "none"
                raise ValueError(
                    f"volume host_path {volume.host_path} is not under the site's allowed_host_paths ({allowed}): "
                    "the site admin lists the host directories trainers may see in allowed_host_paths"
                )
        if self.allowed_host_paths and not _from_site_policy(info):
            # A job file that could grant host directories would let any job author mount the
            # worker's store or AIRFLOW_HOME (process sites refuse a job's confinement alike).
            raise ValueError(
                "allowed_host_paths is the site admin's, not the job's: a job file cannot grant host directories "
                "to its trainers; set allowed_host_paths and volumes in the site policy "
                "(sites.<site>.launcher_spec.container in the worker's FLARE_SITE_CONFIG file or flare_site_policy "
                "variable)"
            )
        paths = [v.mount_path for v in self.volumes]
        dupes = sorted({p for p in paths if paths.count(p) > 1})
        if dupes:
            raise ValueError(f"mount_path {dupes[0]!r} is used by two volumes")
        return self


def _from_site_policy(info: ValidationInfo) -> bool:
    return bool((info.context or {}).get(SITE_POLICY_CONTEXT))


def _privileged_group(gid: int) -> str | None:
    """The name of a privileged host group ``gid`` is (well-known numbers, or this host's groups)."""
    if gid in _PRIVILEGED_GROUP_IDS:
        return _PRIVILEGED_GROUP_IDS[gid]
    for name in _PRIVILEGED_GROUP_NAMES:
        try:
            if grp.getgrnam(name).gr_gid == gid:
                return name
        except KeyError:
            continue
    return None


def protected_mount_problem(host_path: str, protected: Mapping[str, str]) -> str | None:
    """Why a container volume of ``host_path`` may not be mounted: it is, holds or lies inside one
    of ``protected`` (what -> host directory: the model store, AIRFLOW_HOME); ``None`` if clear."""
    for what, top in protected.items():
        if path_within(host_path, top) or path_within(top, host_path):
            return (
                f"volume host_path {host_path} would expose {what} ({top}) to the trainer: other sites' updates, "
                "the round's input model or Airflow's own files; mount a data directory of its own"
            )
    return None
