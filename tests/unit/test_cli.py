"""The CLI's plumbing that needs no Airflow run: where `flare-airflow run` sends Airflow's output.

Run in a fresh interpreter: pytest's own capture replaces ``sys.stdout``, the command does not.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

SCRIPT = """
import os, subprocess, sys
from flare_airflow.cli import _output_to
print("before", flush=True)
try:
    with _output_to(sys.argv[1]):
        print("from python")
        os.write(2, b"from fd 2\\n")
        # A child inherits the redirected descriptors, as Airflow's task subprocesses do.
        subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
        if sys.argv[2] == "raise":
            raise RuntimeError("boom")
except RuntimeError:
    print("raised", flush=True)
print("after", flush=True)
print("stderr is back", file=sys.stderr)
"""


def run(log: pathlib.Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log), mode], capture_output=True, text=True, check=True, timeout=60
    )


def test_output_goes_to_the_log_and_comes_back(tmp_path: pathlib.Path) -> None:
    out = run(tmp_path / "run.log", "ok")
    assert (tmp_path / "run.log").read_text().splitlines() == ["from python", "from fd 2", "from a child"]
    assert out.stdout.splitlines() == ["before", "after"]
    assert out.stderr == "stderr is back\n"


def test_output_is_restored_when_the_body_raises(tmp_path: pathlib.Path) -> None:
    out = run(tmp_path / "run.log", "raise")
    assert (tmp_path / "run.log").read_text().splitlines() == ["from python", "from fd 2", "from a child"]
    assert out.stdout.splitlines() == ["before", "raised", "after"]
    assert out.stderr == "stderr is back\n"
