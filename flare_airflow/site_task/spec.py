"""The site task's spec: :class:`SiteRun`, and the environment names that carry it to the runner."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from flare_airflow.core import envvars
from flare_airflow.core.spec import SiteJob

SPEC_ENV = envvars.FLARE_SITE_JOB_SPEC
# Resolved secret_env values for the trainer, kept out of the SiteRun (which may be logged).
SECRETS_ENV = envvars.FLARE_SITE_SECRETS
# "pid:start_time pid:start_time": processes whose end ends the site job (the task process and its
# supervisor); PR_SET_PDEATHSIG reaches only the direct parent.
OWNERS_ENV = envvars.FLARE_SITE_OWNERS
# A local file (outside the store) where the runner leaves its failure reason for the site task:
# it gets there even when the store is full or read-only and the failure record cannot be written.
RESULT_FILE_ENV = envvars.FLARE_SITE_RESULT_FILE
# The site's noise secret (privacy filters): never in the SiteRun (which may be logged) nor the trainer's environment.
NOISE_SECRET_ENV = envvars.FLARE_SITE_NOISE_SECRET
SUMMARY_PREFIX = "FLARE_RESULT "


@dataclass
class SiteRun:
    """One site task's run of a site job; serialised into the site task's environment.

    A :class:`~flare_airflow.core.spec.SiteJob` is what a launcher needs (identity, argv,
    environment, timeouts); a ``SiteRun`` is what the task around it needs on top: the store
    paths it checks and publishes (input global model, staging, output), the hyper-parameters
    and the local device request. :meth:`site_job` is the one place a SiteJob is made from it,
    the Client API's ``FLARE_*`` variables included, for every backend.
    """

    job: str
    run_id: str
    round: int
    total_rounds: int
    site: str
    task: str
    argv: list[str]
    global_model: str
    # Where an accepted update is published (read by the aggregation, named in the XCom summary).
    output: str
    env: dict[str, str] = field(default_factory=dict)
    hparams: dict[str, Any] = field(default_factory=dict)
    cwd: str | None = None
    launch_timeout: float | None = None
    shutdown_timeout: float = 10.0
    # Local device assignment (sites with a GPU resource manager, not ignore_host).
    assign_gpus: bool = False
    num_gpus: int = 0
    gpu_capacity: int | None = None
    mem_per_gpu_gib: float | None = None
    gpu_wait_timeout: float = 600.0
    # Where the trainer writes (FLARE_OUTPUT): this try's own directory, never the published
    # update. None: the trainer writes ``output`` itself (the server's evaluation task).
    staging: str | None = None
    # sha256 of the input global model as its producer recorded it (FLARE_GLOBAL_SHA256).
    global_sha256: str | None = None
    # The site's privacy plan (core.privacy.plan.PrivacyPlan.to_dict()), applied before publishing.
    privacy: dict[str, Any] | None = None
    # The site policy's confinement of a process site's trainer (mode, network, writable, devices);
    # None: the default, mode auto (flare_airflow.site_task.confinement).
    confinement: dict[str, Any] | None = None
    # The try that runs this job (signed into the update record), and this worker's trust settings
    # (core.trust.settings.TrustSettings.to_dict(): key directory, registry); None: nothing is signed
    # (a trainer tried by hand, the server's evaluation).
    try_number: int | None = None
    trust: dict[str, Any] | None = None
    # A LoRA job's block for the trainer (core.config.lora.LoraSpec.for_trainer): the site's base
    # model path and the digest the runner checks it against before the launch. None: no LoRA.
    lora: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SiteRun:
        return cls(**json.loads(text))

    def site_job(self) -> SiteJob:
        """The launcher's view of this run: its argv and cwd, its ``env`` plus the Client API's variables."""
        env = dict(self.env)
        env.update(
            {
                envvars.FLARE_JOB: self.job,
                envvars.FLARE_RUN_ID: self.run_id,
                envvars.FLARE_SITE: self.site,
                envvars.FLARE_ROUND: str(self.round),
                envvars.FLARE_TOTAL_ROUNDS: str(self.total_rounds),
                envvars.FLARE_TASK: self.task,
                envvars.FLARE_GLOBAL_MODEL: self.global_model,
                envvars.FLARE_OUTPUT: self.staging or self.output,
                envvars.FLARE_HPARAMS: json.dumps(self.hparams),
            }
        )
        if self.global_sha256:
            env[envvars.FLARE_GLOBAL_SHA256] = self.global_sha256
        if self.lora is not None:
            env[envvars.FLARE_LORA] = json.dumps(self.lora)
        return SiteJob(
            job=self.job,
            run_id=self.run_id,
            round=self.round,
            site=self.site,
            argv=tuple(self.argv),
            env=env,
            cwd=self.cwd,
            launch_timeout=self.launch_timeout,
            shutdown_timeout=self.shutdown_timeout,
        )
