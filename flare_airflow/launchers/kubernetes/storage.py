"""What of the model store and of the host a site's pods may reach.

The store: a ``file://`` store reaches a pod only through the site's ``store_mount`` (a PVC or a
host path holding the store root), and the pod mounts only the paths its job needs. The host:
host paths must lie under the site admin's allow-list (``FLARE_K8S_ALLOWED_HOST_PATHS`` on the
machine that builds the pod), never anything the job file asks for.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping

from flare_airflow.core.config import KubernetesLaunchSpec, path_within
from flare_airflow.core.envvars import FLARE_GLOBAL_MODEL, FLARE_K8S_ALLOWED_HOST_PATHS, FLARE_OUTPUT
from flare_airflow.core.spec import SiteJob
from flare_airflow.launchers.errors import LaunchError

# Site policy on the worker, not in the job file: the host path prefixes pods may mount, ':'-separated.
ALLOWED_HOST_PATHS_ENV = FLARE_K8S_ALLOWED_HOST_PATHS


def local_path(location: str) -> str | None:
    """The filesystem path of a store location, or ``None`` for object storage (s3://, gs://, ...)."""
    if location.startswith("file://"):
        return location[len("file://") :]
    if "://" in location:
        return None
    return location


def store_path_in_pod(value: str, store_root: str, mount_path: str) -> str:
    """Where ``value`` (a path or file:// URI under ``store_root``) appears in a pod that mounts the root."""
    root, path = local_path(store_root), local_path(value)
    if root is None:
        raise LaunchError(
            f"store_mount mounts a file:// store, but the model store is {store_root!r}: leave store_mount out "
            "for an object store and give the pod its credentials as secret_env references"
        )
    root = root.rstrip("/") or "/"
    if path is None or not (path == root or path.startswith(root.rstrip("/") + "/")):
        raise LaunchError(f"{value!r} is not under the model store root {store_root!r}: the pod could not reach it")
    relative = path[len(root.rstrip("/")) :]
    if any(part in (".", "..") for part in relative.split("/")):
        raise LaunchError(f"{value!r} has '.' or '..' components: give store locations as plain paths")
    return mount_path.rstrip("/") + relative


def unreachable_store(spec: KubernetesLaunchSpec, store_root: str | None) -> str | None:
    """Why a pod of this site could not reach the model store, or ``None`` if it can."""
    if spec.store_mount is None and store_root is not None and local_path(store_root) is not None:
        return (
            f"the model store {store_root} is a local path the pod cannot see: set launcher_spec.k8s.store_mount "
            "(a PVC or hostPath holding the store), or use an object store (s3://, gs://, ...) with its "
            "credentials as secret_env references"
        )
    return None


def allowed_host_paths(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The host path prefixes pods may mount (:data:`ALLOWED_HOST_PATHS_ENV`, ``':'``-separated).

    ``None`` when the variable is unset: then only the node's system directories are refused (by
    the job's validation). Set but empty: no host path at all. Read from the environment of the
    process that builds the pod (the Airflow worker), never from the job.
    """
    raw = (os.environ if environ is None else environ).get(ALLOWED_HOST_PATHS_ENV)
    if raw is None:
        return None
    prefixes = []
    for entry in filter(None, raw.split(":")):
        if not entry.startswith("/") or posixpath.normpath(entry) != (entry.rstrip("/") or "/"):
            raise LaunchError(
                f"{ALLOWED_HOST_PATHS_ENV}={raw!r}: {entry!r} is not a plain absolute path; "
                "the site admin must fix the worker's setting (e.g. /data:/scratch)"
            )
        prefixes.append(entry.rstrip("/") or "/")
    return tuple(prefixes)


def check_host_paths(site_job: SiteJob, spec: KubernetesLaunchSpec) -> None:
    try:
        allowed = allowed_host_paths()
    except LaunchError as exc:
        raise LaunchError(f"{site_job.label}: {exc}") from None
    if allowed is None:
        return
    used = [(f"volume {vol.name!r}", vol.host_path) for vol in spec.volumes if vol.host_path is not None]
    if spec.store_mount is not None and spec.store_mount.host_path is not None:
        used.insert(0, ("store_mount", spec.store_mount.host_path))
    for what, path in used:
        if not any(path_within(path, top) for top in allowed):
            where = ", ".join(allowed) or "none"
            raise LaunchError(
                f"{site_job.label}: launcher_spec.k8s {what}: host_path {path} is not under a host path this site "
                f"allows ({ALLOWED_HOST_PATHS_ENV}: {where}); use a PVC or a directory under an allowed path, or ask "
                f"the site admin to add it to {ALLOWED_HOST_PATHS_ENV} on the Airflow workers"
            )


def needed_store_paths(site_job: SiteJob, spec: KubernetesLaunchSpec, store_root: str | None) -> dict[str, bool]:
    """The store paths the pod needs, relative to the store root, each with whether it is read-only:
    the input global model's tensors file and record (read-only: not the directory, which also
    holds the previous round's site updates) and the directory holding ``FLARE_OUTPUT``."""
    if spec.store_mount is None or store_root is None:
        return {}
    paths: dict[str, bool] = {}
    model = site_job.env.get(FLARE_GLOBAL_MODEL)
    if model is not None:
        relative = store_path_in_pod(model, store_root, "/").lstrip("/")
        paths[relative] = True
        paths[relative.removesuffix(".safetensors") + ".json"] = True
    output = site_job.env.get(FLARE_OUTPUT)
    if output is not None:
        directory = posixpath.dirname(store_path_in_pod(output, store_root, "/").lstrip("/"))
        # A directory that also holds the input stays writable: the output must be written.
        for path in [p for p in paths if p.startswith(directory + "/")]:
            del paths[path]
        paths[directory] = False
    return paths
