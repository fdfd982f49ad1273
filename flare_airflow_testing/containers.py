"""The project's images for tests: built (or found, cached by content) by ``docker/images.py``.

The tests use a real engine (podman, installed by ``make system-deps``; ``CONTAINER_ENGINE`` picks
another). A build that fails fails the tests that need the images: nothing is skipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES_SCRIPT = ROOT / "docker" / "images.py"
BUILD_TIMEOUT = 1200  # s: a cold machine debootstraps the base and builds both images (~4 min measured)


def engine() -> str:
    chosen = os.environ.get("CONTAINER_ENGINE") or shutil.which("podman")
    if not chosen:
        raise RuntimeError("podman is not installed: run `make system-deps` (or set CONTAINER_ENGINE)")
    return chosen


def build_images(*names: str) -> dict[str, str]:
    """Tags of the named images (all when none), building what is missing."""
    proc = subprocess.run(
        [sys.executable, str(IMAGES_SCRIPT), "--engine", engine(), *names],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"docker/images.py failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def openblas_env() -> list[str]:
    """``-e`` options passing the machine's OPENBLAS_* settings on, unchanged (see INFRA.md)."""
    return [opt for name in sorted(os.environ) if name.startswith("OPENBLAS_") for opt in ("-e", name)]


def trainer_image() -> str:
    """The trainer image's tag for this tree (built, cached by content, when missing)."""
    return build_images("trainer")["trainer"]


@contextlib.contextmanager
def docker_api(run_dir: Path, timeout: float = 60.0) -> Iterator[dict[str, str]]:
    """podman's Docker-compatible API on a private socket (``podman system service``), for the
    docker CLI on a machine without a Docker engine; yields the environment that points the CLI at
    it (``DOCKER_HOST``). The service ends with the block."""
    if shutil.which("docker") is None:
        raise RuntimeError("the docker CLI is not installed: docker sites cannot be tested here")
    run_dir.mkdir(parents=True, exist_ok=True)
    socket = run_dir / "podman.sock"
    env = {"DOCKER_HOST": f"unix://{socket}"}
    with open(run_dir / "service.log", "ab") as log:
        service = subprocess.Popen(
            [engine(), "system", "service", "--time=0", f"unix://{socket}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its whole group ends with it
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            probe = subprocess.run(
                ["docker", "version", "--format", "{{.Server.Version}}"],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                check=False,
            )
            if probe.returncode == 0:
                break
            if service.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"podman's Docker API did not answer at {socket}: {probe.stderr.strip()}; "
                    f"see {run_dir / 'service.log'}"
                )
            time.sleep(0.1)
        yield env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.pid, signal.SIGTERM)
        try:
            service.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
            service.wait()
