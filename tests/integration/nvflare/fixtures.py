"""Session fixtures: NVFlare's and PyTorch's side environments, and jobs NVFlare itself exported and ran.

Built once per machine (flare_airflow_testing/side_venvs.py caches them under /var/tmp/flare-airflow-bench) and
once per session here; a side environment that cannot be built fails the test, never skips it.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
from typing import Any

import pytest

from flare_airflow_testing.side_venvs import SideVenv, nvflare_venv, torch_venv

HERE = pathlib.Path(__file__).resolve().parent
HELLO_CLIENT = HERE / "hello_numpy_client.py"
MAKE_JOBS = HERE / "make_jobs.py"
ROUNDS = 2  # make_jobs.ROUNDS (that script runs in NVFlare's environment, not this one)


@pytest.fixture(scope="session")
def nvflare_side() -> SideVenv:
    side, _versions = nvflare_venv()
    return side


@pytest.fixture(scope="session")
def torch_side() -> SideVenv:
    side, _versions = torch_venv()
    return side


@pytest.fixture(scope="session")
def nvflare_exports(nvflare_side: SideVenv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """hello-full, hello-diff (exported and run in NVFlare's simulator) and cyclic-filtered (exported)."""
    out = tmp_path_factory.mktemp("nvflare-made")
    proc = subprocess.run(
        [str(nvflare_side.python), str(MAKE_JOBS), str(out), str(HELLO_CLIENT), "--simulate"],
        env=nvflare_side.env(),
        cwd=out,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"NVFlare's export/simulator failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return dict(json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT ")))
