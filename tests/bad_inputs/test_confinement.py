"""Bad-input battery, category "site_env": confinement of process trainers (docs/confinement.md, issue 35).

A site policy's ``confinement`` as admins write it in YAML, and a site ``env`` whose ``TMPDIR`` would
break the sandbox: each is refused before the trainer starts, saying why and what to write instead.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from flare_airflow.core.config import apply_site_policy, load_site_policy
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.launchers.process import ProcessLauncher
from flare_airflow.launchers.process.sandbox import ConfinementUnavailable, find_bwrap
from flare_airflow.site_task.runner import run_site
from flare_airflow.site_task.spec import SiteRun
from tests.bad_inputs.cases import Case, assert_clear
from tests.unit.airflow_layer import make_job

PY = sys.executable
OK = (
    "import flare_airflow.client as flare\nm = flare.receive()\n"
    "flare.send(flare.FLModel(params=m.params, meta={'num_samples': 1}))\n"
)

POLICY_CASES = [
    Case("policy-confinement-mode-on", "site_env", "confinement `mode: on` unquoted (YAML 1.1 reads it as true)",
         "sites.site-1.confinement.mode (site 'site-1'): must be 'auto', 'required' or 'off'; `on`/`yes`/`true` "
         "names no mode"),
]  # fmt: skip
TMPDIR_CASES = [
    Case("site-env-tmpdir-root", "site_env", "the site's env sets TMPDIR=/ for a confined trainer",
         "TMPDIR='/' cannot be a confined trainer's temporary directory: it becomes an empty private tmpfs, "
         "which would hide the whole file system; set TMPDIR to /tmp or a directory of its own"),
    Case("site-env-tmpdir-hides-trainer", "site_env",
         "the site's env sets TMPDIR to the directory holding the trainer's script",
         "cannot be a confined trainer's temporary directory: it becomes an empty private tmpfs, which would hide"),
]  # fmt: skip
CASES = POLICY_CASES + TMPDIR_CASES

POLICY_TEXT = {"policy-confinement-mode-on": "sites:\n  site-1: {confinement: {mode: on}}\n"}


def _job(tmp_path: pathlib.Path):
    return make_job(tmp_path, sites={"site-1": {}, "site-2": {}})


@pytest.mark.parametrize("bad_case", POLICY_CASES, ids=[c.id for c in POLICY_CASES])
def test_bad_confinement_policy_gets_a_clear_error(bad_case: Case, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text(POLICY_TEXT[bad_case.id])
    with pytest.raises(ConfigError) as info:
        apply_site_policy(_job(tmp_path), "site-1", load_site_policy(path))
    assert_clear(bad_case, str(info.value))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("written", ["off", "'off'", "no", "false"])
def test_mode_off_as_the_docs_write_it_is_the_opt_out(written: str, tmp_path: pathlib.Path) -> None:
    """YAML 1.1 reads an unquoted ``off`` as false: it must still mean mode 'off' (issue 35)."""
    path = tmp_path / "site.yaml"
    path.write_text(f"sites:\n  site-1: {{confinement: {{mode: {written}}}}}\n")
    job = apply_site_policy(_job(tmp_path), "site-1", load_site_policy(path))
    assert job.sites["site-1"].confinement is not None and job.sites["site-1"].confinement.mode == "off"


def _can_confine() -> bool:
    try:
        find_bwrap()
    except ConfinementUnavailable:
        return False
    return True


@pytest.mark.skipif(not _can_confine(), reason="bubblewrap cannot confine on this host")
@pytest.mark.parametrize("bad_case", TMPDIR_CASES, ids=[c.id for c in TMPDIR_CASES])
def test_a_tmpdir_that_breaks_the_sandbox_is_refused(bad_case: Case, tmp_path: pathlib.Path) -> None:
    store = tmp_path / "store"
    global_model = store / "round-0000" / "global.safetensors"
    write_artifact(global_model, FLModel(params={"w": np.ones(3, np.float32)}))
    script = tmp_path / "trainer" / "train.py"
    script.parent.mkdir()
    script.write_text(OK)
    tmpdir = "/" if bad_case.id == "site-env-tmpdir-root" else str(script.parent)
    output = store / "round-0001" / "sites" / "site-1.safetensors"
    run = SiteRun(
        job="demo", run_id="r", round=1, total_rounds=1, site="site-1", task="train",
        argv=[PY, str(script)], global_model=str(global_model), output=str(output),
        staging=str(store / "round-0001" / "staging" / "site-1" / "try-1" / "update.safetensors"),
        env={"TMPDIR": tmpdir}, shutdown_timeout=2.0, confinement={"mode": "required"},
    )  # fmt: skip
    lines: list[str] = []
    rc, result = run_site(run, ProcessLauncher(sink=lines.append), handle_signals=False)
    assert rc is not JobReturnCode.SUCCESS, result
    assert_clear(bad_case, str(result))
    assert "bwrap:" not in str(result), "bwrap's own message is not the reason"
    assert not output.exists()
