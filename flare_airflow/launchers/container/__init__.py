"""The container backend: a site job is one container of the site's trainer image (podman or docker).

Rooms (the same as every backend's):

* :mod:`.naming` -- the job's identity: the container's name and labels.
* :mod:`.command` -- the one ``run`` command builder (security defaults, mounts, environment).
* :mod:`.state` -- the state table: ``inspect``'s state to ``JobState`` / ``JobReturnCode``
  (exit codes through the core's table, ``docs/state-mapping.md``).
* :mod:`.launcher` -- :class:`ContainerLauncher` (the launcher spec: launch, find, end earlier tries, sweep).
* :mod:`.handle` -- :class:`ContainerJobHandle` (one job's container: poll, wait, terminate, logs).
* :mod:`.engine` -- the engine's command-line contract (timeout, its own exit codes, its error).
"""

from __future__ import annotations

from flare_airflow.launchers.container.command import run_command, store_mounts
from flare_airflow.launchers.container.engine import ContainerEngineError
from flare_airflow.launchers.container.handle import ContainerJobHandle
from flare_airflow.launchers.container.launcher import ContainerLauncher
from flare_airflow.launchers.container.naming import container_name, labels
from flare_airflow.launchers.container.state import launch_failure, map_container

__all__ = [
    "ContainerEngineError",
    "ContainerJobHandle",
    "ContainerLauncher",
    "container_name",
    "labels",
    "launch_failure",
    "map_container",
    "run_command",
    "store_mounts",
]
