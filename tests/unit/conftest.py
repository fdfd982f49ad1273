"""Shared fixtures of the unit tier: scripts written into tmp_path, process checks, small models."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from flare_airflow.core.model import FLModel, write_artifact

REPO = pathlib.Path(__file__).resolve().parents[2]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class Lines:
    """A thread-safe line sink for launchers, with a way to wait for a line."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    @property
    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def wait_for(self, text: str, timeout: float = 15.0) -> str:
        found: list[str] = []

        def seen() -> bool:
            found[:] = [line for line in self.lines if text in line]
            return bool(found)

        assert wait_until(seen, timeout), f"no line containing {text!r} within {timeout}s; got {self.lines}"
        return found[0]


@pytest.fixture
def lines() -> Lines:
    return Lines()


@pytest.fixture
def alive() -> Callable[[int], bool]:
    return pid_alive


@pytest.fixture
def wait() -> Callable[..., bool]:
    return wait_until


@pytest.fixture
def write_script(tmp_path: pathlib.Path) -> Callable[[str, str], pathlib.Path]:
    """Write a (dedented) script into tmp_path and return its path."""

    def write(name: str, source: str) -> pathlib.Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


@pytest.fixture
def global_model(tmp_path: pathlib.Path) -> pathlib.Path:
    """A small global model: ``w`` float32 (2, 3) of ones and ``b`` float32 (3,) of zeros."""
    path = tmp_path / "store" / "demo" / "run" / "round-0000" / "global.safetensors"
    write_artifact(
        path,
        FLModel(params={"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}, metrics={"acc": 0.5}),
    )
    return path


@pytest.fixture
def kill_on_exit():
    """Processes a test registers here are SIGKILLed (by pid) if still alive when it ends."""
    pids: list[int] = []
    yield pids.append
    for pid in pids:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


@pytest.fixture(scope="session")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A fresh virtual environment with only the pinned numpy and safetensors (no Airflow, no pydantic).

    Returns the path of its ``python``. Built once per test session.
    """
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and name.strip() in ("numpy", "safetensors"):
            pins[name.strip()] = version.strip()
    assert set(pins) == {"numpy", "safetensors"}, f"pins not found in requirements.lock: {pins}"
    venv = tmp_path_factory.mktemp("bare") / "venv"
    python = venv / "bin" / "python"
    if importlib.util.find_spec("pip") is not None:
        # The outer pip installs into the new environment (--python): no pip bootstrap there.
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        pip = [sys.executable, "-m", "pip", "--python", str(python)]
    else:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip"]
    install = subprocess.run(
        [
            *pip,
            "install",
            "--quiet",
            "--disable-pip-version-check",
            *(f"{name}=={version}" for name, version in sorted(pins.items())),
        ],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, f"pip install failed:\n{install.stdout}\n{install.stderr}"
    return python


@pytest.fixture(scope="session")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A directory holding a copy of the flare_airflow package (to put on PYTHONPATH, without its dependencies)."""
    root = tmp_path_factory.mktemp("pkg")
    shutil.copytree(REPO / "flare_airflow", root / "flare_airflow", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture(autouse=True)
def _key_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parties' keys made on first use (one-machine trust mode) go to the session's temp dir, not the
    developer's Airflow home; a test that needs strict mode sets ``FLARE_SITE_KEYS`` itself."""
    monkeypatch.setenv("FLARE_KEY_DIR", str(tmp_path_factory.getbasetemp() / "flare-keys"))
    monkeypatch.delenv("FLARE_SITE_KEYS", raising=False)
