"""The site job's owners and leftovers: it ends when the processes that own it end, and leaves no descendant."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence

from flare_airflow.launchers.process import end_processes, job_processes, start_time

_OWNER_POLL_SECONDS = 0.5


def owners_value(pids: Sequence[int]) -> str:
    """The ``FLARE_SITE_OWNERS`` value naming ``pids`` (those still alive) with their start times."""
    return " ".join(f"{pid}:{start}" for pid in pids if pid > 1 and (start := start_time(pid)) is not None)


def parse_owners(text: str) -> list[tuple[int, int]]:
    owners = []
    for item in text.split():
        pid, _, start = item.partition(":")
        if pid.isdigit() and start.isdigit():
            owners.append((int(pid), int(start)))
    return owners


def watch_owners(owners: Sequence[tuple[int, int]], stop: threading.Event) -> None:
    """Send this process SIGTERM (the runner's own stop path) once any owner has ended."""
    while not stop.wait(_OWNER_POLL_SECONDS):
        for pid, start in owners:
            if start_time(pid) != start:
                print(
                    f"process {pid}, which owns this site job, ended: stopping the site job",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return


def end_orphans(grace: float) -> None:
    """End every descendant of this process (a subreaper's adopted orphans included) and reap them."""
    end_processes(lambda: job_processes(roots=(os.getpid(),)), grace)
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
