"""docker/images.py's machine-wide build lock: a second build waits for the first (``make test``'s
background build and a pytest worker asking for the same image)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

IMAGES_PY = pathlib.Path(__file__).resolve().parents[2] / "docker" / "images.py"


def load_images_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("flare_docker_images", IMAGES_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_second_build_waits_for_the_first(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    images = load_images_module()
    done = tmp_path / "first-done"
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import importlib.util, pathlib, sys, tempfile, time\n"
            f"tempfile.tempdir = {str(tmp_path)!r}\n"
            f"spec = importlib.util.spec_from_file_location('m', {str(IMAGES_PY)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "with m.one_build_at_a_time('/usr/bin/podman'):\n"
            "    print('locked', flush=True); time.sleep(1.5)\n"
            f"    pathlib.Path({str(done)!r}).write_text('x')\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with images.one_build_at_a_time("podman"):
            assert done.exists(), "the second build ran while the first held the lock"
        assert time.monotonic() - started >= 1.0
        assert "waiting for another build" in capsys.readouterr().err
    finally:
        first.wait(timeout=30)
    # Another engine has a lock of its own.
    with images.one_build_at_a_time("docker"):
        pass
