"""The project's images for tests: built (or found, cached by content) by ``docker/images.py``.

The tests use a real engine (podman, installed by ``make system-deps``; ``CONTAINER_ENGINE`` picks
another). A build that fails fails the tests that need the images: nothing is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def containers_left(label: str) -> list[str]:
    """Names of the containers with ``label`` (``key=value``) on the engine, running or not."""
    out = subprocess.run(
        [engine(), "ps", "--all", "--format", "{{.Names}}", "--filter", f"label={label}"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return out.split()


class CreatedContainers:
    """Every container the engine creates with ``label`` (``key=value``) while the block runs, and
    the host paths it was given: the engine's event stream (``podman events``) names each new
    container, and its OCI runtime spec (the ``config.json`` podman writes into the container's
    storage when it starts it) is read at once -- the mounts the runtime really made, not what a
    caller asked for. ``created``: one dict per container, ``{"id", "labels", "mounts"}`` with
    ``mounts`` the bind mounts from the host as ``(source, destination, read_only)`` (podman's own,
    such as ``/etc/hosts`` from the container's storage, left out), or ``"error"`` when the
    container was gone before its spec could be read. Rootful podman only (its storage layout)."""

    def __init__(self, label: str, timeout: float = 60.0) -> None:
        self.label = label
        self.timeout = timeout
        self.created: list[dict[str, Any]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._stores: list[str] = []

    def __enter__(self) -> CreatedContainers:
        info = subprocess.run(
            [engine(), "info", "--format", "{{.Store.GraphRoot}} {{.Store.RunRoot}}"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        self._stores = info.split()
        argv = [engine(), "events", "--format", "json", "--filter", "event=create", "--filter", f"label={self.label}"]
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, args=(self._proc,), daemon=True)
        self._reader.start()
        return self

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip():
                event = json.loads(line)
                found = {"id": event["ID"], "labels": event.get("Attributes") or {}}
                self.created.append({**found, **self._spec_mounts(event["ID"])})

    def _spec_mounts(self, container: str) -> dict[str, Any]:
        userdata = [Path(store, "overlay-containers", container, "userdata") for store in self._stores]
        config = userdata[0] / "config.json"
        started = time.monotonic()
        while time.monotonic() < started + self.timeout:
            try:
                spec = json.loads(config.read_text())
            except (FileNotFoundError, json.JSONDecodeError):  # not started yet, or being written
                # Its storage exists from its creation on (before the event): gone means removed.
                if not userdata[0].parent.exists() and time.monotonic() > started + 2:
                    return {"error": f"container {container} was removed before its spec could be read"}
                time.sleep(0.005)
                continue
            mounts = []
            for mount in spec.get("mounts", []):
                options = mount.get("options") or []
                own = any(Path(mount.get("source", "/")).is_relative_to(u) for u in userdata)
                if {"bind", "rbind"} & set(options) and not own:
                    mounts.append((mount["source"], mount["destination"], "ro" in options))
            return {"mounts": mounts}
        return {"error": f"no runtime spec of container {container} within {self.timeout}s"}

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait(15)
        if self._reader is not None:
            self._reader.join(self.timeout + 10)
