"""What every backend launches: the trainer's exact argv, and how its output lines are marked."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from flare_airflow.core.nvflare.run import wrapper_argv

if TYPE_CHECKING:  # the configuration layer (pydantic) is not loaded by the process backend
    from flare_airflow.core.config import JobConfig, SlurmLaunchSpec
    from flare_airflow.core.spec import SiteJob

# What the trainer image runs the script with when the site names no trainer_command.
IMAGE_DEFAULT_COMMAND = ("python",)


class TrainerImage(Protocol):
    """What an image backend's block says about the trainer inside its image."""

    @property
    def trainer_command(self) -> Sequence[str] | None: ...

    @property
    def trainer_script(self) -> str | None: ...


def trainer_argv(
    job: JobConfig,
    image: TrainerImage | None = None,
    *,
    cluster: SlurmLaunchSpec | None = None,
) -> list[str]:
    """The trainer's exact argv, ``command + [script] + trainer.args`` (never a shell string).

    On this host (``image`` is ``None``): the job's ``trainer.command``, by default this Python,
    and the trainer script resolved against the job file's directory. In a site's image
    (``image``, the block of an image backend: ``launcher_spec.k8s``, ``.container``):
    ``image.trainer_command``, by default ``python`` (the job's ``trainer.command`` names the
    worker's interpreter, which the image does not have), and ``image.trainer_script``, by
    default ``trainer.script`` as given.

    A job with ``trainer.nvflare`` runs the script through the NVFlare compatibility runner
    (``command -m flare_airflow.core.nvflare.run --params-exchange .. --transfer .. script args``), the
    same way on every backend; its command must be a Python interpreter (or ``torchrun``).

    On a SLURM cluster (``cluster``, the site's ``launcher_spec.slurm`` block):
    ``cluster.trainer_command`` and ``cluster.trainer_script`` when given; otherwise, submitting
    locally, this host's argv (the compute nodes share its file system and Python); through SSH,
    the job's ``trainer.command`` (default ``python3``) and ``trainer.script`` as given.
    """
    trainer = job.trainer
    compat = trainer.nvflare
    # Resolved in the trainer's own environment (a pod's image, a SLURM node), never this host's paths.
    runner = wrapper_argv(compat.params_exchange, compat.transfer) if compat is not None else []
    if cluster is not None:
        local = cluster.ssh_conn_id is None
        cluster_command = cluster.trainer_command or trainer.command or ([sys.executable] if local else ["python3"])
        script = cluster.trainer_script or (str(job.script_path()) if local else trainer.script)
        return [*cluster_command, *runner, script, *trainer.args]
    if image is None:
        return [*(trainer.command or [sys.executable]), *runner, str(job.script_path()), *trainer.args]
    command = image.trainer_command or IMAGE_DEFAULT_COMMAND
    return [*command, *runner, image.trainer_script or trainer.script, *trainer.args]


def output_prefix(job: SiteJob) -> str:
    """The prefix of a trainer's output lines in a log shared by several site jobs: ``[site rN] ``."""
    return f"[{job.site} r{job.round}] "
