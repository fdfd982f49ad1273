"""Bad-input battery, category "update_file": an update or record a trainer leaves as a link or a
non-regular file (issue 35). ``check_result`` reads every backend's result (the site runner for
process and SLURM sites, the site-outputs step for pods and containers), so one run of the real
site runner per case covers them: the site fails with the reason and nothing is published.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import failure_path
from flare_airflow.launchers.process import ProcessLauncher
from flare_airflow.site_task.runner import run_site
from flare_airflow.site_task.spec import SiteRun
from tests.bad_inputs.cases import Case, assert_clear

PY = sys.executable
# Each trainer leaves its "update" in FLARE_OUTPUT's place by a trick instead of flare.send().
HEAD = """
import os, pathlib, shutil
from flare_airflow.core.store import record_path
out = pathlib.Path(os.environ["FLARE_OUTPUT"])
glob = pathlib.Path(os.environ["FLARE_GLOBAL_MODEL"])
"""
TRICKS = {
    "update-symlink-to-global-model": "os.symlink(glob, out)\nshutil.copy(record_path(glob), record_path(out))\n",
    "update-record-symlink": (
        "import flare_airflow.client as flare\nm = flare.receive()\n"
        "flare.send(flare.FLModel(params=m.params, meta={'num_samples': 1}))\n"
        "real = out.with_name('elsewhere.json')\nrecord_path(out).rename(real)\nos.symlink(real, record_path(out))\n"
    ),
    "update-hardlink-to-global-model": "os.link(glob, out)\nshutil.copy(record_path(glob), record_path(out))\n",
    "update-fifo": "os.mkfifo(out)\nshutil.copy(record_path(glob), record_path(out))\n",
}
CASES = [
    Case("update-symlink-to-global-model", "update_file",
         "the trainer leaves its update as a symlink to the input global model, with the global model's record",
         "is a symbolic link (to "),
    Case("update-record-symlink", "update_file", "the trainer leaves the update's record as a symlink",
         "update file {staging}/update.json is a symbolic link"),
    Case("update-hardlink-to-global-model", "update_file",
         "an unconfined trainer hard-links the input global model as its update",
         "has 2 hard links (a link to another file); it must be a regular file the trainer wrote in"),
    Case("update-fifo", "update_file", "the trainer leaves a FIFO as its update (a reader would block)",
         "is not a regular file; it must be a regular file the trainer wrote in"),
]  # fmt: skip


@pytest.mark.parametrize("bad_case", CASES, ids=[c.id for c in CASES])
def test_a_linked_or_special_update_is_refused(bad_case: Case, tmp_path: pathlib.Path) -> None:
    store = tmp_path / "store"
    global_model = store / "round-0000" / "global.safetensors"
    write_artifact(global_model, FLModel(params={"w": np.ones(3, np.float32)}, meta={"num_samples": 3}))
    before = global_model.read_bytes()
    script = tmp_path / "trainer.py"
    script.write_text(HEAD + TRICKS[bad_case.id])
    output = store / "round-0001" / "sites" / "site-1.safetensors"
    staging = store / "round-0001" / "staging" / "site-1" / "try-1"
    # A hard link across the sandbox's mounts fails (EXDEV): the check is for unconfined trainers.
    mode = "off" if "hardlink" in bad_case.id else "auto"
    run = SiteRun(
        job="demo", run_id="r", round=1, total_rounds=1, site="site-1", task="train",
        argv=[PY, str(script)], global_model=str(global_model), output=str(output),
        staging=str(staging / "update.safetensors"), shutdown_timeout=2.0, confinement={"mode": mode},
    )  # fmt: skip
    lines: list[str] = []
    rc, result = run_site(run, ProcessLauncher(sink=lines.append), handle_signals=False)
    assert rc is not JobReturnCode.SUCCESS, f"{bad_case.id}: published: {result}"
    error = bad_case.error.format(staging=staging)
    assert_clear(Case(bad_case.id, bad_case.category, bad_case.bad_input, error), str(result))
    assert not output.exists() and failure_path(output).exists()
    assert global_model.read_bytes() == before
