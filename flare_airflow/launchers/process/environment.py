"""What a local trainer starts with: its environment, and the checks made before starting it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from flare_airflow.core.envvars import FLARE_SITE_JOB_SPEC, FLARE_SITE_SECRETS
from flare_airflow.core.spec import SiteJob
from flare_airflow.launchers.errors import LaunchError

# Variables of the Airflow worker that a trainer must never see (database URLs, connections, keys).
_HIDDEN_PREFIXES = ("AIRFLOW", "_AIRFLOW", FLARE_SITE_JOB_SPEC, FLARE_SITE_SECRETS)


def trainer_environment(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The trainer's environment: the worker's minus Airflow's own variables, plus ``extra``."""
    env = {k: v for k, v in base.items() if not k.startswith(_HIDDEN_PREFIXES)}
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_environment(job: SiteJob) -> None:
    """Refuse variables no process can receive, naming the variable (never its value)."""
    for name, value in job.env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise LaunchError(
                f"{job.label}: environment variable {name!r} must be a string with a string value, "
                f"got {type(value).__name__}; quote it in the site's launcher_spec.process.env"
            )
        if not name or "=" in name or "\0" in name:
            raise LaunchError(
                f"{job.label}: {name!r} cannot be an environment variable name (empty, '=' or a NUL byte); "
                "fix the site's launcher_spec.process.env"
            )
        if "\0" in value:
            raise LaunchError(
                f"{job.label}: the value of environment variable {name!r} contains a NUL byte, which no "
                "process environment can hold; fix it in the site's launcher_spec.process.env"
            )


def check_launchable(job: SiteJob, search_path: str) -> None:
    """Say what is wrong before starting: a missing working directory or trainer program.

    Without this check ``Popen`` reports a missing ``cwd`` as the program not being found.
    """
    cwd = job.cwd
    if cwd is not None:
        if not os.path.exists(cwd):
            raise LaunchError(
                f"{job.label}: cannot start the trainer: the working directory {cwd!r} does not exist "
                "on this host; "
                "create it or change the site's launcher_spec.process.cwd"
            )
        if not os.path.isdir(cwd):
            raise LaunchError(
                f"{job.label}: cannot start the trainer: the working directory {cwd!r} is not a directory; "
                "change the site's launcher_spec.process.cwd"
            )
        if not os.access(cwd, os.X_OK):
            raise LaunchError(
                f"{job.label}: cannot start the trainer: the working directory {cwd!r} cannot be entered "
                f"by this user (uid {os.getuid()}); "
                "fix its permissions or change the site's launcher_spec.process.cwd"
            )
    program = job.argv[0]
    if "/" not in program:
        if shutil.which(program, path=search_path) is None:
            raise LaunchError(
                f"{job.label}: cannot start {program!r}: the program was not found on PATH ({search_path}); "
                "install it, give its absolute path in trainer.command, or fix PATH in the site's env"
            )
        return
    path = os.path.join(cwd or os.getcwd(), program)
    if not os.path.exists(path):
        raise LaunchError(
            f"{job.label}: cannot start {program!r}: no such file"
            + (f" (relative to the working directory {cwd!r})" if not os.path.isabs(program) else "")
            + "; fix trainer.command or install the interpreter on this host"
        )
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise LaunchError(
            f"{job.label}: cannot start {program!r}: not an executable file; "
            "fix trainer.command (or make the file executable: chmod +x)"
        )
