"""Where a SLURM site's commands run: this worker, or the cluster's login node over an Airflow SSH
connection (apache-airflow-providers-ssh's ``SSHHook``; no hand-written SSH).

Over SSH every command is ``shlex.join(argv)`` (each word quoted for the remote shell), the batch
script travels on stdin, and the job's output is read with ``tail -c +N`` from where the last read
stopped. One SSH client per :class:`SshCommands` (a trigger keeps it across polls).
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Sequence
from typing import Any

from flare_airflow.core.config import SlurmLaunchSpec
from flare_airflow.launchers.slurm import (
    CommandResult,
    LocalCommands,
    SlurmCommandError,
    SlurmCommands,
)
from flare_airflow.launchers.slurm.commands import COMMAND_TIMEOUT


class SshCommands(SlurmCommands):
    """SLURM's commands on a login node, through the Airflow SSH connection ``ssh_conn_id``."""

    def __init__(self, ssh_conn_id: str) -> None:
        self.ssh_conn_id = ssh_conn_id
        self._client: Any = None
        self._home: str | None = None
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        if self._client is not None:
            transport = self._client.get_transport()
            if transport is not None and transport.is_active():
                return self._client
        from airflow.providers.ssh.hooks.ssh import SSHHook

        try:
            self._client = SSHHook(ssh_conn_id=self.ssh_conn_id).get_conn()
        except Exception as exc:  # the hook raises several types (connection missing, auth, network)
            raise SlurmCommandError(
                f"cannot connect through the SSH connection {self.ssh_conn_id!r}: {str(exc).splitlines()[0][:300]}"
            ) from None
        return self._client

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float = COMMAND_TIMEOUT) -> CommandResult:
        command = shlex.join(argv)
        with self._lock:
            try:
                client = self._connect()
                channel_in, out, err = client.exec_command(command, timeout=timeout)
                if stdin is not None:
                    channel_in.write(stdin)
                channel_in.channel.shutdown_write()
                stdout = out.read().decode(errors="surrogateescape")
                stderr = err.read().decode(errors="replace")
                code = out.channel.recv_exit_status()
            except SlurmCommandError:
                raise
            except Exception as exc:  # paramiko / socket errors: the connection is gone
                self.close()
                raise SlurmCommandError(f"{command[:200]} over SSH ({self.ssh_conn_id}) failed: {exc}") from None
        return CommandResult(code, stdout, stderr)

    def home(self) -> str:
        if self._home is None:
            res = self.run(["sh", "-c", 'printf %s "$HOME"'])
            if res.returncode != 0 or not res.stdout.startswith("/"):
                raise SlurmCommandError(f"cannot read $HOME on the login node of {self.ssh_conn_id!r}")
            self._home = res.stdout
        return self._home

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            finally:
                self._client = None


def slurm_commands(spec: SlurmLaunchSpec | str) -> SlurmCommands:
    """The commands of a site's ``connection`` (``local`` or ``ssh:<conn id>``)."""
    connection = spec if isinstance(spec, str) else spec.connection
    if connection.startswith("ssh:"):
        return SshCommands(connection.removeprefix("ssh:"))
    return LocalCommands()
