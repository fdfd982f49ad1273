"""The ONE place a site job's batch script and ``sbatch`` command line are built.

The script is fixed text plus ``export NAME=<quoted>`` lines and the trainer's argv, every word
quoted with :func:`shlex.quote`: no user string reaches the shell unquoted, and no user string
becomes an ``#SBATCH`` line (options go on ``sbatch``'s command line, each one argv word).

One task (``nodes * tasks_per_node == 1``): the script ``exec``s the trainer, so ``scancel``'s
signal reaches it. More: ``srun`` runs the trainer once per task with torchrun's variables
(``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` =
the first node's ``NodeAddr``, ``MASTER_PORT``) and ``--kill-on-bad-exit=1``: when one rank fails the whole job
ends. Only rank 0's ``send()`` writes the site's update (the Client API reads ``RANK``).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence

from flare_airflow.core.config import ResourceSpec, SlurmLaunchSpec
from flare_airflow.core.config.resources import quantity_bytes
from flare_airflow.core.spec import SiteJob

# The per-task wrapper srun runs (fixed text; the trainer's argv follows as "$@").
_RANK_WRAPPER = 'export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" NODE_RANK="$SLURM_NODEID"; exec "$@"'
# MASTER_PORT when the site names none: stable per job, in a range clear of common services.
_PORT_BASE = 20000
_PORT_SPAN = 20000


def batch_script(job: SiteJob, spec: SlurmLaunchSpec, extra_env: Mapping[str, str] | None = None) -> str:
    """The batch script of ``job``: its environment, then the trainer (once, or once per task)."""
    env = {**job.env, **(extra_env or {})}
    lines = [
        "#!/bin/bash",
        f"# flare-airflow site job {shlex.quote(job.label)}: built from an argv, every word quoted",
        "set -eu",
    ]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    lines.append('export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"')
    argv = shlex.join(job.argv)
    if spec.world_size == 1:
        lines.append(f"exec {argv}")
    else:
        port = str(spec.master_port) if spec.master_port else f"$(( {_PORT_BASE} + SLURM_JOB_ID % {_PORT_SPAN} ))"
        lines += [
            # The first node's address as slurmctld reaches it (NodeAddr; node names need not resolve).
            'first_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            'export MASTER_ADDR="$(scontrol -o show node "$first_node" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")"',
            f"export MASTER_PORT={port}",
            'export WORLD_SIZE="$SLURM_NTASKS"',
            f"export LOCAL_WORLD_SIZE={spec.tasks_per_node}",
            f"exec srun --kill-on-bad-exit=1 --ntasks-per-node={spec.tasks_per_node} "
            f"bash -c {shlex.quote(_RANK_WRAPPER)} flare-rank {argv}",
        ]
    return "\n".join(lines) + "\n"


def sbatch_argv(
    spec: SlurmLaunchSpec,
    resources: ResourceSpec,
    *,
    name: str,
    output: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """``sbatch --parsable`` with the site's policy and the job's resources; the script comes on stdin."""
    argv = ["sbatch", "--parsable", f"--job-name={name}", f"--output={output}"]
    argv += [f"--nodes={spec.nodes}", f"--ntasks-per-node={spec.tasks_per_node}"]
    if spec.cwd:
        argv.append(f"--chdir={spec.cwd}")
    for option, value in (
        ("--partition", spec.partition),
        ("--account", spec.account),
        ("--qos", spec.qos),
        ("--time", spec.time_limit),
    ):
        if value:
            argv.append(f"{option}={value}")
    if resources.num_of_gpus:
        argv.append(f"--gres=gpu:{resources.num_of_gpus}")
    if resources.num_of_cpus:
        argv.append(f"--cpus-per-task={math.ceil(resources.num_of_cpus)}")
    if resources.memory:
        argv.append(f"--mem={math.ceil(quantity_bytes(resources.memory) / 2**20)}M")
    return [*argv, *spec.extra_sbatch_options, *extra]


def parse_job_id(stdout: str) -> str:
    """The job id ``sbatch --parsable`` printed (``<id>`` or ``<id>;<cluster>``), or ``""``."""
    first = stdout.strip().splitlines()[0] if stdout.strip() else ""
    job_id = first.split(";")[0].strip()
    return job_id if job_id.isdigit() else ""
