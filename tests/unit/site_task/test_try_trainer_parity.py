"""``try-trainer`` and the site task accept and refuse the same updates, for the same reason.

Both build their run with :func:`flare_airflow.site_task.build.train_run` and check it with
:func:`flare_airflow.site_task.checks.check_result`; this table keeps it so (issue 38 item 4).
Each row's update is sent by a real trainer under ``try-trainer`` (a real CLI process) and
written by the same code into a site task's staging place, then accepted by ``accept_update``
on the site's worker, with the site's policy applied on both sides.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.store import path_from_uri
from flare_airflow.operators.site_outputs import accept_update
from flare_airflow.operators.site_steps import SiteJobFailed, job_at_site, make_site_run
from tests.unit.airflow_layer import FakeTI, context, make_job
from tests.unit.site_task import parity_trainer

TRAINER = pathlib.Path(parity_trainer.__file__)
NOISE_SECRET = "0048d92e674fa28bd2f5b4538ab89b6ee5cc3825d3b7aab3101d4769ac874a0e"
POLICY = (
    "sites:\n  site-1:\n    privacy:\n      delta: 1.0e-5\n      public_metrics: [loss]\n"
    "      filters: [{type: gaussian, clip: 0.5, noise_multiplier: 1.0}]\n"
)
# (kind, accepted?, a part of the reason both sides give)
ROWS = [
    ("good", True, ""),
    ("clipped", True, ""),
    ("wrong_shape", False, "shape"),
    ("nan", False, "finite"),
    ("symlink", False, "is a symbolic link"),
    ("private_metric", False, "patients_seen"),
    ("renamed", False, "weights"),
    ("none", False, "sent no update"),
]


class PushingTI(FakeTI):
    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[("self", key)] = value


@pytest.fixture
def setup(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    policy = tmp_path / "site.yaml"
    policy.write_text(POLICY)
    job = make_job(tmp_path, trainer={"script": str(TRAINER)}, privacy={"public_metrics": ["loss"]})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        yaml.safe_dump(
            {
                "job": job.job,
                "rounds": job.rounds,
                "min_clients": job.min_clients,
                "initial_model": "init.safetensors",
                "trainer": {"script": str(TRAINER)},
                "privacy": {"public_metrics": ["loss"]},
                "sites": {"site-1": {}, "site-2": {}},
            }
        )
    )
    monkeypatch.setenv("FLARE_SITE_CONFIG", str(policy))
    monkeypatch.setenv("AIRFLOW_VAR_FLARE_NOISE_SECRET", NOISE_SECRET)
    monkeypatch.setenv("FLARE_PRIVACY_LEDGER", str(tmp_path / "site-ledger.sqlite"))
    return {"job": job, "job_file": job_file, "policy": policy, "tmp": tmp_path}


def site_task_verdict(job: Any, kind: str) -> tuple[bool, str, dict[str, Any] | None]:
    """``kind`` sent in a site task (pod / SLURM / sensor path) and checked on the site's worker."""
    at_site = job_at_site(job, "site-1", context(), 1)
    ti = PushingTI()
    run = make_site_run(at_site, "site-1", 1, context(ti), argv=["python", str(TRAINER), kind])
    staging = pathlib.Path(str(path_from_uri(run.staging)))
    staging.parent.mkdir(parents=True, exist_ok=True)
    global_model = pathlib.Path(str(path_from_uri(run.global_model)))
    write_artifact(global_model, FLModel(params=read_artifact(job.initial_model_path())[0]))
    parity_trainer.write_update(kind, staging, global_model)
    try:
        summary = accept_update(context(ti), "site-1", 1, run)
    except SiteJobFailed as exc:
        reason = str(exc).split(" failed: ", 1)[1]
        return False, normalise(reason), None
    return True, "", summary


def try_trainer_verdict(setup: dict[str, Any], kind: str) -> tuple[bool, str]:
    """``kind`` sent by the trainer under ``flare-airflow try-trainer`` (a real CLI process)."""
    work = setup["tmp"] / f"try-{kind}"
    job_file = setup["job_file"]
    data = yaml.safe_load(job_file.read_text())
    data["trainer"]["args"] = [kind]
    job_file.write_text(yaml.safe_dump(data))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flare_airflow.cli",
            "try-trainer",
            str(job_file),
            "--site",
            "site-1",
            "--workdir",
            str(work),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        # The site's policy file as its worker names it; the site's ledger, which a trial must not charge.
        env={**os.environ, "FLARE_PRIVACY_LEDGER": str(setup["tmp"] / "site-ledger-of-trials.sqlite")},
    )
    if out.returncode == 0:
        return True, ""
    found = re.search(r"FAILED \[\w+\]: (.*)", out.stderr)
    assert found, out.stderr
    return False, normalise(found.group(1))


def normalise(reason: str) -> str:
    """The reason without the place that differs by design: the run's directory in the store."""
    return re.sub(r"/[^\s']*/(round-\d{4}/)", r"<run>/\1", reason)


@pytest.mark.parametrize(("kind", "accepted", "reason"), ROWS, ids=[row[0] for row in ROWS])
def test_try_trainer_and_the_site_task_agree(setup: dict[str, Any], kind: str, accepted: bool, reason: str) -> None:
    task_ok, task_reason, summary = site_task_verdict(setup["job"], kind)
    try_ok, try_reason = try_trainer_verdict(setup, kind)
    assert (task_ok, try_ok) == (accepted, accepted), (task_reason, try_reason)
    assert try_reason == task_reason
    assert reason in task_reason
    if accepted:
        assert summary is not None and [f["type"] for f in summary["privacy"]["filters"]] == ["gaussian"]
    # A trial never charges the site's ledger: its release goes to a ledger in its work directory.
    assert not (setup["tmp"] / "site-ledger-of-trials.sqlite").exists()
    assert (setup["tmp"] / f"try-{kind}" / "privacy-ledger.sqlite").exists() is accepted


def test_every_site_run_is_built_in_one_place() -> None:
    """``SiteRun(`` appears only in its builder (and its own module): a caller that builds its own
    run is how ``try-trainer`` drifted from the site task before."""
    package = pathlib.Path(parity_trainer.__file__).parents[3] / "flare_airflow"
    allowed = {package / "site_task" / "build.py", package / "site_task" / "spec.py"}
    builders = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path not in allowed and re.search(r"\bSiteRun\(", path.read_text())
    )
    assert builders == []


def test_a_trial_runs_the_sites_plan_signs_nothing_and_has_its_own_ledger(setup: dict[str, Any]) -> None:
    from flare_airflow.cli import try_trainer

    job = try_trainer.job_at_site(setup["job"], "site-1", str(setup["policy"]))  # what --site-policy does
    work = setup["tmp"] / "trial"
    run = try_trainer.site_run(job, "site-1", work, read_artifact(job.initial_model_path())[0], {}, 1)
    task = make_site_run(job_at_site(setup["job"], "site-1", context(), 1), "site-1", 1, context(), argv=run.argv)
    assert run.privacy is not None and task.privacy is not None
    assert run.privacy.pop("ledger_file") == str(work / try_trainer.TRIAL_LEDGER)
    assert run.privacy == task.privacy  # the same plan: the policy's gaussian, the job's public names
    assert (run.trust, task.trust is not None) == (None, True)  # the site task signs; a trial does not
    assert try_trainer.trial_noise_secret(run) != try_trainer.trial_noise_secret(run)  # fresh, never the site's
