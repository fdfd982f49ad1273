"""A real NVIDIA FLARE deployment for tests: NVFlare's POC mode (a server and clients as separate
processes) in NVFlare's side environment (flare_airflow_testing/side_venvs.py).

``nvflare poc prepare -n N`` provisions a project; its server ports are NVFlare's fixed defaults
(8002/8003), which another POC on the machine would share, so the project file is rewritten with
free ports and provisioned again (``prepare -i``). ``nvflare poc start`` runs in its own session:
the server and clients it starts stay in that process group, so :meth:`Poc.stop` can prove that
nothing is left (``nvflare poc stop``, then a scan of /proc; any survivor is killed by id and
reported as a failure). Its own HOME keeps ``~/.nvflare`` out of the user's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Protocol

import yaml

from flare_airflow_testing.ports import free_port
from flare_airflow_testing.side_venvs import tail


class PocError(RuntimeError):
    """The POC system could not be prepared or started (the message carries NVFlare's output)."""


def pids_of_group(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def pids_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if text.encode() in fh.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


class NvflareVenv(Protocol):
    """An environment with NVFlare installed (:class:`~flare_airflow_testing.side_venvs.SideVenv`,
    or a benchmark's own record of the same venv)."""

    venv: Path

    def env(self) -> dict[str, str]: ...


class Poc:
    """NVFlare's POC system with ``n`` clients (``site-1`` ... ``site-n``) under ``root``."""

    def __init__(self, side: NvflareVenv, root: Path, n: int = 2) -> None:
        self.side = side
        self.root = root
        self.n = n
        self.ws = root / "poc"
        home = root / "home"
        home.mkdir(parents=True, exist_ok=True)
        self.env = {**side.env(), "HOME": str(home), "NVFLARE_POC_WORKSPACE": str(self.ws)}
        self.pgid: int | None = None
        self.leftovers: list[str] = []

    @property
    def nvflare(self) -> str:
        return str(self.side.venv / "bin" / "nvflare")

    def _run(self, *args: str, timeout: float = 120) -> str:
        proc = subprocess.run(
            [self.nvflare, *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise PocError(f"`nvflare {' '.join(args)}` exited {proc.returncode}: {proc.stdout[-1500:]}")
        return proc.stdout

    @property
    def prod(self) -> Path:
        found = sorted(self.ws.glob("*/prod_*"))
        if not found:
            raise PocError(f"no provisioned POC kit under {self.ws}")
        return found[-1]

    @property
    def admin_kit(self) -> Path:
        return self.prod / "admin@nvidia.com"

    def prepare(self) -> None:
        self._run("poc", "prepare", "-n", str(self.n), "--force")
        project = yaml.safe_load((self.ws / "project.yml").read_text())
        for participant in project["participants"]:
            if participant["type"] == "server":
                participant["fed_learn_port"] = free_port()
                participant["admin_port"] = free_port()
        project_file = self.root / "project.yml"
        project_file.write_text(yaml.safe_dump(project))
        self._run("poc", "prepare", "-i", str(project_file), "--force")

    def start(self) -> None:
        log = self.root / "poc-start.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [self.nvflare, "poc", "start"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.pgid = proc.pid
            try:
                rc = proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                rc = -1
        text = log.read_text(errors="replace")
        if rc != 0 or f"Clients ready: {self.n}/{self.n}" not in text:
            self.stop()
            raise PocError(f"`nvflare poc start` ({self.n} clients) exited {rc}: {tail(log, 40)}")

    def running(self) -> list[int]:
        return sorted(set(pids_of_group(self.pgid) if self.pgid else []) | set(pids_mentioning(str(self.ws))))

    def stop(self) -> list[str]:
        """Stop the system; the processes that had to be killed by id (empty when it ended by itself)."""
        with contextlib.suppress(PocError, subprocess.TimeoutExpired):
            self._run("poc", "stop", timeout=120)
        deadline = time.monotonic() + 30
        left = self.running()
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = self.running()
        for pid in left:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")[:160]
            except OSError:
                cmd = "?"
            self.leftovers.append(f"{pid}: {cmd}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return self.leftovers
