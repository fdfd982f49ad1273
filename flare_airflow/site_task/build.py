"""The one place a :class:`~flare_airflow.site_task.spec.SiteRun` is made from a job, for every caller.

The fused site task, the sensor of a launched job, the aggregation's evaluation and ``try-trainer``
all build their run here, so what a site applies to an update (its privacy plan, the checks of
:func:`~flare_airflow.site_task.checks.check_result`, the signature) cannot drift between them.
Nothing here needs Airflow: what only the Airflow layer knows (the run id, the run's rounds and
hyper-parameters from the trigger form, the try, the verified digest of the input global model,
the worker's trust settings) is passed in as plain values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from flare_airflow.core.config import JobConfig
from flare_airflow.core.store import ModelStore
from flare_airflow.site_task.spec import SiteRun


def train_run(
    job: JobConfig,
    site: str,
    round_num: int,
    *,
    store: ModelStore,
    run_id: str,
    total_rounds: int,
    hparams: Mapping[str, Any],
    argv: list[str],
    try_number: int,
    global_sha256: str | None,
    trust: dict[str, Any] | None,
    as_process: bool = False,
    ledger_file: str | None = None,
) -> SiteRun:
    """The site job of (run, round, site, try): identity, Client API paths, privacy plan, devices.

    The trainer writes into this try's staging directory; the update is published at the site's
    place in ``store`` only once it passed every check. ``global_sha256``: the input global model's
    digest as its producer's proven record gives it (the trainer start verifies the model by it).
    ``trust``: this worker's trust settings (the update is signed with the site's key), ``None``
    to sign nothing. ``as_process``: run the trainer here as the site's process block would,
    whatever the site's backend, without assigning the site's GPUs (``try-trainer``).
    ``ledger_file``: the privacy ledger the release is charged to, instead of the site's (a trial
    must not spend the site's budget).
    """
    spec = job.sites[site]
    process = spec.launcher_spec.process
    manager = spec.resource_manager
    local = as_process or spec.backend.on_worker
    gpu_manager = manager is not None and manager.type == "gpu" and not manager.ignore_host
    site_env = process.env if as_process else spec.block.env if spec.backend.site_env else {}
    plan = job.privacy_plan(site)
    if plan is not None and ledger_file is not None:
        plan = replace(plan, ledger_file=ledger_file)
    return _run(
        job,
        site=site,
        round_num=round_num,
        task="train",
        run_id=run_id,
        total_rounds=total_rounds,
        hparams=hparams,
        argv=argv,
        global_model=str(store.global_model(job.job, run_id, round_num - 1)),
        output=str(store.site_update(job.job, run_id, round_num, site)),
        staging=str(store.staging(job.job, run_id, round_num, site, try_number)),
        global_sha256=global_sha256,
        env=dict(site_env),
        cwd=str(job.resolve(process.cwd)) if local and process.cwd else None,
        # A trial takes no lock on the site's GPUs (it would queue behind the site's own jobs).
        assign_gpus=not as_process and local and gpu_manager,
        num_gpus=spec.resource_spec.num_of_gpus,
        gpu_capacity=manager.num_of_gpus if manager is not None else None,
        mem_per_gpu_gib=spec.resource_spec.mem_per_gpu_in_GiB,
        privacy=plan.to_dict() if plan is not None else None,
        confinement=spec.confinement.model_dump() if local and spec.confinement is not None else None,
        try_number=try_number,
        trust=trust,
    )


def evaluation_run(
    job: JobConfig,
    site: str,
    round_num: int,
    *,
    run_id: str,
    total_rounds: int,
    hparams: Mapping[str, Any],
    argv: list[str],
    global_model: str,
    output: str,
) -> SiteRun:
    """The server's evaluation of round ``round_num``'s global model, as site ``site``.

    The same trainer as the sites'; no staging (the trainer writes its metrics at ``output``
    itself), no site environment, no devices, no privacy plan, nothing signed.
    """
    return _run(
        job,
        site=site,
        round_num=round_num,
        task="evaluate",
        run_id=run_id,
        total_rounds=total_rounds,
        hparams=hparams,
        argv=argv,
        global_model=global_model,
        output=output,
    )


def _run(
    job: JobConfig,
    *,
    site: str,
    round_num: int,
    task: str,
    run_id: str,
    total_rounds: int,
    hparams: Mapping[str, Any],
    argv: list[str],
    **paths_and_devices: Any,
) -> SiteRun:
    """What every site run takes from the job and the run: identity, rounds, hyper-parameters, timeouts,
    and a LoRA job's block with the site's base model."""
    base_model = job.base_model_path(site)
    lora = None
    if job.lora is not None and base_model is not None:
        lora = job.lora.for_trainer(str(base_model), job.aggregator.frozen())
    return SiteRun(
        job=job.job,
        run_id=run_id,
        round=round_num,
        total_rounds=total_rounds,
        site=site,
        task=task,
        argv=argv,
        hparams=dict(hparams),
        launch_timeout=job.trainer.launch_timeout,
        shutdown_timeout=job.trainer.shutdown_timeout,
        lora=lora,
        **paths_and_devices,
    )
