"""A FLARE deployment's admin API, reached through the bridge program (:mod:`.bridge`) run by the
interpreter of an environment that has ``nvflare`` installed.

Why a separate program: ``nvflare`` is not in flare-airflow's lock (its own pins, and heavy), so
Airflow's workers and triggerer never import it. Each call is ``[python, bridge.py, COMMAND]`` (an
argv list, never a shell string) with the request as JSON on stdin; the admin credentials are the
startup kit's *location* and the user, read from an Airflow connection by the hook
(:mod:`flare_airflow.hooks.flare_admin`), never from the DAG. Nothing here imports Airflow.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flare_airflow.launchers.process.tree import child_preexec
from flare_airflow.nvflare_native import bridge as _bridge
from flare_airflow.nvflare_native.errors import (
    FlareAdminError,
    FlareConnectionError,
    FlareCredentialError,
    FlareJobError,
    FlareNotReadyError,
)

BRIDGE = Path(_bridge.__file__).resolve()
PREFIX = _bridge.PREFIX
ERRORS: dict[str, type[FlareAdminError]] = {
    "credential": FlareCredentialError,
    "connection": FlareConnectionError,
    "not_ready": FlareNotReadyError,
    "job": FlareJobError,
    "conflict": FlareJobError,
}
# One login (~2-3 s: interpreter, nvflare import, TLS) plus the command; a hung server must not hang a task.
CALL_TIMEOUT = 180.0


@dataclass(frozen=True)
class FlareAdmin:
    """Where and as whom to reach a FLARE deployment's admin API.

    :param python: the interpreter of an environment with ``nvflare`` (>= 2.9) installed.
    :param startup_kit: the admin user's provisioned startup kit folder (``startup/fed_admin.json``,
        its certificate and key); it names the server's address.
    :param username: the admin user (FLARE takes the identity from the kit's certificate).
    :param connect_timeout: seconds to establish a session.
    """

    python: str
    startup_kit: str
    username: str = "admin@nvidia.com"
    connect_timeout: float = 10.0

    def argv(self, command: str) -> list[str]:
        return [self.python, str(BRIDGE), command]

    def request(self, **fields: Any) -> str:
        return json.dumps(
            {
                "startup_kit": self.startup_kit,
                "username": self.username,
                "connect_timeout": self.connect_timeout,
                **fields,
            }
        )

    def call(self, command: str, *, call_timeout: float = CALL_TIMEOUT, **fields: Any) -> dict[str, Any]:
        """Run one bridge command; its last answer, or the typed error it reported."""
        try:
            proc = subprocess.run(
                self.argv(command),
                input=self.request(**fields),
                capture_output=True,
                text=True,
                timeout=call_timeout,
                check=False,
                preexec_fn=child_preexec(),  # a task killed with -9 takes its bridge call along
            )
        except FileNotFoundError:
            raise FlareCredentialError(
                f"the NVFlare interpreter {self.python!r} does not exist: set the Airflow connection's "
                "extra 'python' to the python of an environment with nvflare installed"
            ) from None
        except subprocess.TimeoutExpired:
            raise FlareConnectionError(
                f"the FLARE admin command {command!r} did not answer within {call_timeout:.0f} s"
            ) from None
        answers = parse_answers(proc.stdout)
        return last_answer(answers, command, proc.returncode, proc.stderr)

    def submit(
        self,
        job_folder: str,
        token: str,
        *,
        expected_clients: Sequence[str] | int | None = None,
        ready_timeout: float = 60.0,
    ) -> dict[str, Any]:
        """Submit ``job_folder`` under ``token`` (retry-safe: see the bridge) once ``expected_clients``
        (names, or how many) are connected; ``job_id``, ``adopted``, ``status``, ``clients``."""
        expected = expected_clients if isinstance(expected_clients, int | None) else list(expected_clients)
        return self.call(
            "submit",
            call_timeout=ready_timeout + CALL_TIMEOUT,
            job_folder=job_folder,
            token=token,
            expected_clients=expected,
            ready_timeout=ready_timeout,
        )

    def status(self, job_id: str) -> str:
        return str(self.call("status", job_id=job_id)["status"])

    def abort(self, job_id: str) -> str:
        """Abort the job (nothing happens to a finished one); its status afterwards."""
        return str(self.call("abort", job_id=job_id)["status"])

    def download(self, job_id: str, destination: str) -> Path:
        """Download the job's result (the server's job workspace) under ``destination``."""
        return Path(str(self.call("download", job_id=job_id, destination=destination)["path"]))

    def watch_argv(self) -> list[str]:
        return self.argv("watch")


def parse_answers(stdout: str) -> list[dict[str, Any]]:
    """The bridge's answer lines (NVFlare's own output in between is skipped)."""
    answers = []
    for line in stdout.splitlines():
        if line.startswith(PREFIX):
            try:
                answers.append(dict(json.loads(line[len(PREFIX) :])))
            except ValueError:
                continue
    return answers


def raise_for(answer: dict[str, Any]) -> None:
    error = answer.get("error")
    if error is None:
        return
    kind = str(error.get("kind", "internal"))
    raise ERRORS.get(kind, FlareAdminError)(str(error.get("message", "")))


def last_answer(answers: list[dict[str, Any]], command: str, returncode: int, stderr: str) -> dict[str, Any]:
    if answers:
        raise_for(answers[-1])
        if returncode == 0:
            return answers[-1]
    tail = "\n".join(stderr.strip().splitlines()[-8:])
    raise FlareAdminError(f"the FLARE admin bridge ({command}) exited {returncode} without an answer: {tail}")
