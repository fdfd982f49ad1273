"""The process backend: a site job is a local process started from an exact argv (never a shell).

Rooms (the same as every backend's):

* :mod:`.naming` -- the job's identity: the mark (``FLARE_PROCESS_TREE``) its processes inherit.
* :mod:`.environment` -- what the trainer starts with: its environment, and the checks made
  before starting it (working directory, program, variables).
* the state table is the core's exit-code table (:func:`flare_airflow.core.exit_codes.map_exit`,
  ``docs/state-mapping.md``), shared by every backend.
* :mod:`.tree` -- the job's processes in ``/proc``, ending them, child subreaper and
  die-with-parent.
* :mod:`.launcher` -- :class:`ProcessLauncher` / :class:`ProcessJobHandle` (the launcher spec).
"""

from __future__ import annotations

from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.process.environment import check_environment, check_launchable, trainer_environment
from flare_airflow.launchers.process.launcher import ProcessJobHandle, ProcessLauncher
from flare_airflow.launchers.process.naming import TREE_MARK_ENV
from flare_airflow.launchers.process.tree import (
    become_subreaper,
    die_with_parent,
    end_processes,
    job_processes,
    start_time,
)

__all__ = [
    "TREE_MARK_ENV",
    "LaunchError",
    "ProcessJobHandle",
    "ProcessLauncher",
    "become_subreaper",
    "check_environment",
    "check_launchable",
    "die_with_parent",
    "end_processes",
    "job_processes",
    "start_time",
    "trainer_environment",
]
