"""The SLURM backend: a site job is one batch job (``sbatch``). Usable without Airflow.

Rooms (the same as every backend's):

* :mod:`.naming` -- the job's identity: :func:`job_name` (``fl-<job>-<site>-r<round>-<hash>-t<try>``,
  every try of a site job shares :func:`site_job_prefix`) and its output file.
* :mod:`.script` -- the ONE place the batch script and the ``sbatch`` command line are built, from
  the trainer's argv (every word quoted) and the site's ``launcher_spec.slurm``.
* :mod:`.state` -- the state table (:func:`map_job`, ``docs/state-mapping.md``).
* :mod:`.commands` -- SLURM's client commands here or on a login node (:class:`SlurmCommands`),
  and what they print (``scontrol``, ``sacct``, ``squeue``, ``scancel``).
* :mod:`.launcher` -- :class:`SlurmLauncher` / :class:`SlurmJobHandle` (the launcher spec).
"""

from __future__ import annotations

from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.slurm.commands import (
    CommandResult,
    FoundJob,
    JobInfo,
    LocalCommands,
    SlurmCommandError,
    SlurmCommands,
    cancel,
    find_jobs,
    list_jobs,
    parse_show_job,
    read_job,
    submit_environment,
)
from flare_airflow.launchers.slurm.launcher import (
    TAIL_LINES,
    OutputReader,
    SlurmJobHandle,
    SlurmLauncher,
    SubmittedJob,
)
from flare_airflow.launchers.slurm.naming import job_name, output_file, site_job_prefix, try_of
from flare_airflow.launchers.slurm.script import batch_script, parse_job_id, sbatch_argv
from flare_airflow.launchers.slurm.state import map_job, waits_its_turn

__all__ = [
    "TAIL_LINES",
    "CommandResult",
    "FoundJob",
    "JobInfo",
    "LaunchError",
    "LocalCommands",
    "OutputReader",
    "SlurmCommandError",
    "SlurmCommands",
    "SlurmJobHandle",
    "SlurmLauncher",
    "SubmittedJob",
    "batch_script",
    "cancel",
    "find_jobs",
    "job_name",
    "list_jobs",
    "map_job",
    "output_file",
    "parse_job_id",
    "parse_show_job",
    "read_job",
    "sbatch_argv",
    "site_job_prefix",
    "submit_environment",
    "try_of",
    "waits_its_turn",
]
