"""The FLARE job trigger's watcher (the admin bridge, a child process) ends with the process that
started it: a triggerer killed with -9 leaves no bridge polling FLARE behind. The bridge here is a
stand-in (``sleep``), named as such: what is tested is the process tie, not FLARE."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WATCH = """
import asyncio, sys
from flare_airflow.nvflare_native.admin import FlareAdmin
from flare_airflow.triggers.flare_job import FlareJobTrigger

trigger = FlareJobTrigger(job_id="j-1", flare_conn_id="unused")
print("watching", flush=True)
asyncio.run(trigger._watch_once(FlareAdmin(python=sys.argv[1], startup_kit="/nonexistent")))
"""


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(stat[1]) == pid and stat[0] not in ("Z", "X"):
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_watcher_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    stand_in = tmp_path / "python"  # the "NVFlare interpreter": runs the bridge's argv as a long sleep
    stand_in.write_text("#!/bin/sh\nexec sleep 1000\n")
    stand_in.chmod(0o755)
    bridge: list[int] = []
    triggerer = subprocess.Popen(
        [sys.executable, "-c", WATCH, str(stand_in)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )
    try:
        assert triggerer.stdout is not None and triggerer.stdout.readline().strip() == "watching"
        deadline = time.monotonic() + 30
        while not (bridge := _children(triggerer.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(bridge) == 1, "the watcher did not start"
        os.kill(triggerer.pid, signal.SIGKILL)
        triggerer.wait(10)
        deadline = time.monotonic() + 5
        while _alive(bridge[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(bridge[0]), "the bridge outlived the triggerer killed with -9"
    finally:
        if triggerer.poll() is None:
            triggerer.kill()
        for pid in bridge:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
