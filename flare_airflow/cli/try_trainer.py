"""``flare-airflow try-trainer JOB --site S``: run a job's trainer by hand, as one site, in one round.

What a trainer author runs before a whole federated run: the job's trainer, for one site, against
the job's initial model (or any plain safetensors file), started exactly as a process site starts
it -- the site runner, the Client API's variables, the site's ``env`` and ``cwd`` -- and its update
put through the same checks the site task applies before an update may count. Nothing here needs
Airflow, a database or a scheduler; everything lands in a work directory that is kept for reading.
"""

from __future__ import annotations

import json
import pathlib
import secrets as secrets_module
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from flare_airflow.core.config import (
    SITE_CONFIG_ENV,
    JobConfig,
    apply_site_policy,
    load_job,
    load_model_file,
    load_site_policy,
)
from flare_airflow.core.config.validators import hparam_value
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.privacy.plan import PrivacyPlan
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import ModelStore
from flare_airflow.launchers.trainer import trainer_argv
from flare_airflow.site_task.build import train_run
from flare_airflow.site_task.checks import budget_refusal
from flare_airflow.site_task.runner import run_site
from flare_airflow.site_task.spec import SiteRun

RUN_ID = "try-trainer"
# The trial's own privacy ledger, in its work directory.
TRIAL_LEDGER = "privacy-ledger.sqlite"


def parse_hparams(job: JobConfig, pairs: Sequence[str]) -> dict[str, Any]:
    """The job's hyper-parameters with ``key=value`` overrides (values in JSON: ``lr=0.1``, ``name="x"``)."""
    hparams: dict[str, Any] = dict(job.trainer.hparams)
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--hparam {pair!r}: write KEY=VALUE, e.g. --hparam lr=0.1")
        if key not in hparams:
            known = ", ".join(hparams) or "none (the job's trainer.hparams is empty)"
            raise ConfigError(f"--hparam {key!r}: not a hyper-parameter of job {job.job!r}; known: {known}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare word is a string
        try:
            hparams[key] = hparam_value(f"--hparam {key}", hparams[key], value, job.trainer.hparam_ranges.get(key))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return hparams


def site_run(
    job: JobConfig, site: str, workdir: pathlib.Path, params: Mapping[str, Any], hparams: dict[str, Any], round_num: int
) -> SiteRun:
    """The site job a process site would run for (``try-trainer``, ``round_num``, ``site``), in ``workdir``.

    Built by the site task's own builder, so the site's privacy plan and every result check apply
    as at the site; but a trial signs nothing (the site's key stays with the site task) and its
    release is charged to a ledger of its own in ``workdir``, never to the site's.
    """
    store = ModelStore(workdir)
    record = write_artifact(store.global_model(job.job, RUN_ID, round_num - 1), FLModel(params=dict(params)))
    return train_run(
        job,
        site,
        round_num,
        store=store,
        run_id=RUN_ID,
        total_rounds=max(job.rounds, round_num),
        hparams=hparams,
        argv=trainer_argv(job),
        try_number=1,
        global_sha256=record.sha256,
        trust=None,
        as_process=True,
        ledger_file=str(workdir / TRIAL_LEDGER),
    )


def job_at_site(job: JobConfig, site: str, policy_file: str | None) -> JobConfig:
    """The job as the site's policy file (``--site-policy``, else ``$FLARE_SITE_CONFIG``) makes it."""
    if not policy_file:
        return job
    return apply_site_policy(job, site, load_site_policy(policy_file))


def trial_noise_secret(run: SiteRun) -> str | None:
    """A fresh noise secret for this trial when the plan adds noise: the site's own secret stays
    on its worker (a trial's noise must not repeat the site's real release's)."""
    if run.privacy is None or not PrivacyPlan.from_dict(run.privacy).adds_noise:
        return None
    return secrets_module.token_hex(32)


def try_trainer(
    job_file: str,
    site: str,
    *,
    model: str | None = None,
    round_num: int = 1,
    hparams: Sequence[str] = (),
    workdir: str | None = None,
    environ: Mapping[str, str] | None = None,
    site_policy: str | None = None,
) -> int:
    """Run the trainer once; 0 when its update passed every check, 1 when the trainer or its update failed."""
    job = load_job(job_file)
    if site not in job.sites:
        raise ConfigError(f"--site {site!r}: job {job.job!r} has no such site; its sites: {', '.join(job.sites)}")
    if not 1 <= round_num <= 1000:
        raise ConfigError(f"--round {round_num}: must be from 1 to 1000")
    if model is None:
        params = load_model_file(job.initial_model_path(), f"initial_model {job.initial_model!r}")
    else:
        params = load_model_file(pathlib.Path(model), f"--model {model!r}")
    environ = environ if environ is not None else {}
    job = job_at_site(job, site, site_policy or environ.get(SITE_CONFIG_ENV))
    spec = job.sites[site]
    if not spec.backend.on_worker:
        print(
            f"note: site {site!r} runs {spec.launcher} jobs; try-trainer runs its trainer here as a local process "
            f"({' '.join(trainer_argv(job))})",
            file=sys.stderr,
        )
    # The process block's (what this local run is) and the site's own backend's: a SLURM or
    # container site's Airflow references, a Kubernetes site's Secret references.
    names = list(dict.fromkeys([*spec.launcher_spec.process.secret_env, *spec.block.secret_env]))
    secrets = {name: environ[name] for name in names if name in environ}
    missing = [name for name in names if name not in environ]
    if missing:
        print(
            f"note: site {site!r} gives its trainer secret_env {', '.join(missing)}: try-trainer does not read "
            "Airflow's connections or variables; export them in this shell to pass them",
            file=sys.stderr,
        )
    root = pathlib.Path(workdir) if workdir else pathlib.Path(tempfile.mkdtemp(prefix=f"flare-try-{job.job}-"))
    root.mkdir(parents=True, exist_ok=True)
    run = site_run(job, site, root.resolve(), params, parse_hparams(job, hparams), round_num)
    print(f"trainer: {' '.join(run.argv)}")
    print(f"site {site}, round {round_num}, hparams {json.dumps(run.hparams)}")
    print(f"global model: {run.global_model}")
    sys.stdout.flush()
    refused = budget_refusal(run)
    result: dict[str, Any] | str
    if refused is not None:
        rc, result = JobReturnCode.CONFIG_ERROR, refused
    else:
        rc, result = run_site(run, secrets=secrets, noise_secret=trial_noise_secret(run))
    if rc is JobReturnCode.SUCCESS and isinstance(result, dict):
        metrics = ", ".join(f"{k}={v:.6g}" for k, v in sorted(result["metrics"].items())) or "none"
        print(
            f"update accepted: {result['params_type']} update of {result['num_samples']} sample(s), "
            f"metrics {metrics}\n  {run.output} (sha256 {result['sha256']})"
        )
        return 0
    print(f"FAILED [{rc.name}]: {result}", file=sys.stderr)
    print(f"work directory (kept): {root}", file=sys.stderr)
    return 1
