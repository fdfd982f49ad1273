"""A real OpenSSH server on loopback for the SLURM-over-SSH tests (Debian ``openssh-server``).

Started by the tests on a free port with its own host key, config and authorized key (key auth
only, no passwords), in its own session; stopped with its whole process group. Sessions get
``SetEnv`` variables (``SLURM_CONF`` of the test cluster), as a login node's profile would.
Never skipped: a server that cannot start raises.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from flare_airflow_testing.ports import free_port

SSHD = "/usr/sbin/sshd"


class SshdError(RuntimeError):
    """sshd could not start: the tests using it fail."""


class Sshd:
    def __init__(self, run_dir: Path, session_env: Mapping[str, str]) -> None:
        self.run_dir = Path(run_dir)
        self.session_env = dict(session_env)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.client_key = self.run_dir / "client_key"
        self.user = "root"

    def start(self, timeout: float = 20.0) -> Sshd:
        if not os.path.exists(SSHD):
            raise SshdError(f"{SSHD} is not installed: run `make system-deps` (Debian openssh-server)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        host_key = self.run_dir / "host_ed25519"
        for key in (host_key, self.client_key):
            if not key.exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        authorized = self.run_dir / "authorized_keys"
        authorized.write_text(self.client_key.with_suffix(".pub").read_text())
        authorized.chmod(0o600)
        self.port = free_port()
        set_env = " ".join(f"{k}={v}" for k, v in self.session_env.items())
        config = self.run_dir / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    "ListenAddress 127.0.0.1",
                    f"Port {self.port}",
                    f"HostKey {host_key}",
                    f"PidFile {self.run_dir / 'sshd.pid'}",
                    f"AuthorizedKeysFile {authorized}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "X11Forwarding no",
                    "AllowTcpForwarding no",
                    *([f"SetEnv {set_env}"] if set_env else []),
                    "",
                ]
            )
        )
        log = (self.run_dir / "sshd.log").open("ab")
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SshdError(f"sshd exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return self
            time.sleep(0.1)
        self.stop()
        raise SshdError(f"sshd did not answer on 127.0.0.1:{self.port}: {self.log_tail()}")

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.run_dir / "sshd.log").read_text(errors="replace")[-2000:]
        return ""

    def connection_uri_json(self) -> str:
        """An Airflow SSH connection (JSON, for ``AIRFLOW_CONN_<ID>``) to this server with key auth."""
        import json

        return json.dumps(
            {
                "conn_type": "ssh",
                "host": "127.0.0.1",
                "port": self.port,
                "login": self.user,
                "extra": {"key_file": str(self.client_key), "no_host_key_check": "true"},
            }
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
