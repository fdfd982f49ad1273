"""The project's images for tests: built (or found, cached by content) by ``docker/images.py``.

The tests use a real engine (podman, installed by ``make system-deps``; ``CONTAINER_ENGINE`` picks
another). A build that fails fails the tests that need the images: nothing is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
