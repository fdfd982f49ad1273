"""The steps every site task takes, as functions: the may-run check, the site policy, the site run,
the secrets, and the failure that names the reason.

:class:`~flare_airflow.operators.lifecycle.SiteTaskLifecycle` runs them in order for every backend's
site task; the launch + sensor pair and the aggregation's evaluation use the same functions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from flare_airflow.core.backends import BACKENDS
from flare_airflow.core.config import (
    SITE_CONFIG_ENV,
    SITE_POLICY_VARIABLE,
    JobConfig,
    SitePolicy,
    apply_site_policy,
    load_site_policy,
    site_policy_from_text,
)
from flare_airflow.core.errors import ConfigError, FlareAirflowError
from flare_airflow.core.failure_record import write_failure
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.trust import CENTRAL, TrustError
from flare_airflow.hooks.secrets import secret_value
from flare_airflow.launchers.trainer import trainer_argv
from flare_airflow.operators.bindings import binding
from flare_airflow.operators.common import (
    FINISHED_STATES,
    push_failure,
    run_id_of,
    run_params,
    store_for,
    task_states,
)
from flare_airflow.operators.trust import trust_settings
from flare_airflow.site_task.build import evaluation_run, train_run
from flare_airflow.site_task.checks import budget_refusal
from flare_airflow.site_task.spec import SiteRun

if TYPE_CHECKING:
    from flare_airflow.core.spec import JobLauncherSpec

# FLARE_SITE of the server's evaluation of a global model, run by the aggregation task.
SERVER_SITE = "server"


class SiteJobFailed(FlareAirflowError, AirflowException):
    """A site's trainer failed or sent an unusable update."""


def site_failed(context: Context, site: str, round_num: int, reason: str) -> SiteJobFailed:
    """The error that fails a site task; its reason also goes to XCom (key ``failure``), which the
    aggregation reads when the store could not take the failure record (full, read-only)."""
    push_failure(context, reason)
    return SiteJobFailed(f"site {site!r} round {round_num} failed: {reason}")


def resolve_secret_env(job: JobConfig, site: str) -> dict[str, str]:
    """The ``secret_env`` of the site's own launcher block (backends whose secrets are Airflow
    references: process, SLURM, container), resolved on this worker and masked in logs.

    Raises :class:`SiteJobFailed` naming the site, the variable and the reference it could not
    resolve. The values go to the site runner in its environment (never argv, XCom or the store).
    """
    from airflow.sdk.log import mask_secret

    values: dict[str, str] = {}
    spec = job.sites[site]
    refs = spec.block.secret_env if spec.backend.worker_secrets else {}
    for name, ref in refs.items():
        try:
            value = secret_value(ref)
        except Exception as exc:  # the Task SDK raises several types for "not found"
            detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            where = (
                f"AIRFLOW_VAR_{ref.variable.upper()}" if ref.variable else f"AIRFLOW_CONN_{str(ref.conn_id).upper()}"
            )
            raise SiteJobFailed(
                f"site {site!r}: secret_env {name} could not be resolved from {ref.describe()}: {detail}; "
                f"create it in Airflow (UI, CLI, a secrets backend or {where}) on the workers that run this site"
            ) from None
        mask_secret(value, name)
        values[name] = value
    return values


class SiteVariableRefused(ConfigError):
    """The API server refused a site task a variable the site keeps on its own worker (strict mode)."""


def site_variable(name: str, what: str, how: str) -> str | None:
    """The Airflow variable ``name`` as a site task resolves it: the worker's own environment and
    secrets backend first, then the Execution API -- or None when nobody has it.

    In strict mode the API server refuses a site task any variable its grant does not list, and
    the Task SDK then raises instead of returning the default (an authoritative deny must not fall
    through). That refusal means "not on this worker": raises :class:`SiteVariableRefused` saying
    what ``what`` is and ``how`` to set it on the worker, instead of the SDK's bare exception.
    """
    from airflow.sdk import Variable
    from airflow.sdk.exceptions import AirflowSecretsBackendAccessDenied

    try:
        value = Variable.get(name, default=None)
    except AirflowSecretsBackendAccessDenied:
        raise SiteVariableRefused(
            f"{what}: the Airflow variable {name!r} is not in this worker's environment or secrets backend, and "
            f"the API server refuses site tasks the central one (strict mode: a site keeps its own); {how}"
        ) from None
    return None if value is None else str(value)


def noise_secret_for(run: SiteRun) -> str | None:
    """The site's noise secret when its privacy plan adds noise (else None), resolved on this
    worker from the Airflow variable the plan names and masked in logs.

    The site keeps it (its worker's variables or secrets backend), so the server cannot
    regenerate the site's noise; the noise of (job, run, round, site) is keyed from it
    (:func:`~flare_airflow.core.privacy.filters.noise_key`), so a retry republishes the same
    release. Raises :class:`SiteJobFailed` saying how to create it when it is missing.
    """
    from airflow.sdk.log import mask_secret

    from flare_airflow.core.privacy.plan import PrivacyPlan
    from flare_airflow.core.privacy.secret import set_on_site_worker, weak_secret_problem

    if run.privacy is None:
        return None
    plan = PrivacyPlan.from_dict(run.privacy)
    if not plan.adds_noise:
        return None
    what = f"site {run.site!r}: its privacy plan adds noise, keyed by the site's secret"
    how = f"{set_on_site_worker(plan.noise_secret_variable)}, and keep it for the run's lifetime"
    try:
        value = site_variable(plan.noise_secret_variable, what, how)
    except SiteVariableRefused as exc:
        raise SiteJobFailed(str(exc)) from None
    if not value:
        raise SiteJobFailed(
            f"{what} in the Airflow variable {plan.noise_secret_variable!r}, which this worker does not have; {how}"
        )
    mask_secret(value, plan.noise_secret_variable)
    problem = weak_secret_problem(value, plan.noise_secret_variable)
    if problem is not None:
        raise SiteJobFailed(f"site {run.site!r}: {problem}")
    return value


def check_site_budget(run: SiteRun) -> None:
    """Before the trainer starts: refuse a site task whose release would take the site beyond its
    privacy budget (the ledger on this worker, every job and run). Raises :class:`SiteJobFailed`
    with the budget, the spent ε and the would-be ε."""
    reason = budget_refusal(run)
    if reason is not None:
        raise SiteJobFailed(reason)


def site_policy_path() -> str | None:
    """This worker's site policy file: ``$FLARE_SITE_CONFIG``, else Airflow's ``[flare] site_config``."""
    path = os.environ.get(SITE_CONFIG_ENV)
    if path:
        return path
    from airflow.configuration import conf

    return conf.get("flare", "site_config", fallback=None) or None


def site_policy() -> SitePolicy | None:
    """This worker's site policy, or ``None`` when it has none (the central, one-machine default).

    The policy file (:func:`site_policy_path`) if the worker names one, else the Airflow variable
    :data:`SITE_POLICY_VARIABLE`, looked up as Airflow looks up any variable from a task: the
    worker's own ``AIRFLOW_VAR_FLARE_SITE_POLICY`` and secrets backend first, then the metastore
    (which strict mode refuses to site tasks: :class:`SiteVariableRefused`, a ``ConfigError``).
    """
    path = site_policy_path()
    if path:
        return load_site_policy(path)
    text = site_variable(
        SITE_POLICY_VARIABLE,
        "this worker's site policy",
        f"set AIRFLOW_VAR_{SITE_POLICY_VARIABLE.upper()} (the policy as YAML or JSON) in the environment of the "
        f"site's worker, or point ${SITE_CONFIG_ENV} or [flare] site_config there at the policy file",
    )
    if text is None:
        return None
    return site_policy_from_text(text, f"Airflow variable {SITE_POLICY_VARIABLE}")


def job_at_site(job: JobConfig, site: str, context: Context, round_num: int) -> JobConfig:
    """The job as this worker runs ``site``: the job's request on top of the site's policy.

    A policy that cannot be read or that the request does not fit fails the task with the reason
    (also in XCom and in the site's failure record, where the aggregation reads it).
    """
    try:
        policy = site_policy()
        return job if policy is None else apply_site_policy(job, site, policy)
    except ConfigError as exc:
        raise site_config_failed(context, job, site, round_num, str(exc)) from None


def site_config_failed(context: Context, job: JobConfig, site: str, round_num: int, reason: str) -> Exception:
    """A site task refused before its job started: the reason goes in the site's failure record
    (where the aggregation reads it) and in the returned exception, which the caller raises."""
    store = store_for(job)
    write_failure(store.site_update(job.job, run_id_of(context), round_num, site), JobReturnCode.CONFIG_ERROR, reason)
    return site_failed(context, site, round_num, reason)


def site_routing(job: JobConfig, site: str) -> dict[str, str]:
    """The ``queue`` and ``executor`` that send a site's tasks to the site's own worker
    (docs/deploy-across-sites.md); empty for a site on Airflow's defaults (the central side, where
    the aggregation and bookkeeping tasks always run)."""
    where = {"queue": job.site_queue(site), "executor": job.sites[site].executor}
    return {key: value for key, value in where.items() if value is not None}


def site_task_defaults(job: JobConfig, site: str, kwargs: dict[str, Any]) -> None:
    """Task arguments every site task gets from the site's spec: pool, queue, executor, retries, timeout."""
    spec = job.sites[site]
    pool = spec.pool_name(site)
    if pool is not None:
        # One slot per GPU: the pool's slots are the site's GPUs (see docs/gpu-pools.md); a
        # multi-node site job holds its GPUs on every node.
        kwargs.setdefault("pool", pool)
        kwargs.setdefault("pool_slots", spec.gpus_per_job)
    for key, value in site_routing(job, site).items():
        kwargs.setdefault(key, value)
    kwargs.setdefault("retries", spec.retries)
    kwargs.setdefault("retry_delay", timedelta(seconds=spec.retry_delay_seconds))
    if job.trainer.timeout:
        kwargs.setdefault("execution_timeout", timedelta(seconds=job.trainer.timeout))


def skip_beyond_rounds(context: Context, job: JobConfig, round_num: int) -> None:
    params = run_params(context, job)
    if round_num > params.rounds:
        raise AirflowSkipException(
            f"round {round_num} skipped: this run asked for {params.rounds} of at most {job.rounds} rounds"
        )


def check_site_task_may_run(context: Context, job: JobConfig, site: str, round_num: int) -> None:
    """Skip a round beyond the run's ``rounds``; refuse a site task whose round was already aggregated.

    A site task cleared on its own (e.g. 'Clear' with 'Only failed' after the round's aggregation
    ran or was skipped) would train, succeed and never count: its aggregation is not run again.
    It fails instead, before its trainer starts, saying what to clear.
    """
    skip_beyond_rounds(context, job, round_num)
    task: Any = context.get("task")
    downstream = sorted(getattr(task, "downstream_task_ids", None) or ())
    done = {t: s for t, s in task_states(context, downstream).items() if s in FINISHED_STATES}
    if done:
        task_id, state = sorted(done.items())[0]
        ti: Any = context["ti"]
        reason = (
            f"site {site!r} round {round_num} not run: the round's aggregation {task_id} already finished ({state}) "
            f"and was not cleared with this task, so this site's update could never count. Clear {task_id} too, "
            f"with 'Downstream' on and 'Only failed' off, or run `flare-airflow resume {ti.dag_id} "
            f"{run_id_of(context)} --from-round {round_num}`"
        )
        push_failure(context, reason)  # where the Federated runs page and `flare-airflow run` read it
        raise AirflowFailException(reason)


def produced_sha256(context: Context, task_id: str | None) -> str | None:
    """The sha256 that task ``task_id`` (prepare or a round's aggregation) recorded in its XCom."""
    ti: Any = context.get("ti")
    if task_id is None or not hasattr(ti, "xcom_pull"):
        return None
    summary = ti.xcom_pull(task_ids=task_id)
    sha256 = summary.get("sha256") if isinstance(summary, dict) else None
    return str(sha256) if sha256 else None


def verified_global_sha256(
    context: Context, job: JobConfig, site: str, round_num: int, global_task_id: str | None
) -> str | None:
    """The sha256 of the input global model, from the central side's signed record in its
    producer's XCom once that record is proven (signed by the central key, for this job, run and
    round ``round_num - 1``); every backend's trainer start then checks the model against it.

    A record that is refused (unsigned or an unknown key in strict mode, another round's record,
    a digest changed after signing) refuses this site's start: the reason goes in the site's
    failure record and XCom, and the trainer never sees the model.
    """
    ti: Any = context.get("ti")
    if global_task_id is None or not hasattr(ti, "xcom_pull"):
        return None
    summary = ti.xcom_pull(task_ids=global_task_id)
    if not isinstance(summary, dict) or not summary.get("sha256"):
        return None
    run_id = run_id_of(context)
    what = f"site {site!r} round {round_num}: the input global model's record (from {global_task_id})"
    expect = {"job": job.job, "run_id": run_id, "round": round_num - 1, "sha256": summary["sha256"]}
    try:
        payload, note = trust_settings().verify(summary.get("signed"), party=CENTRAL, expect=expect, what=what)
    except TrustError as exc:
        raise site_config_failed(context, job, site, round_num, f"{exc}; the trainer was not started") from None
    if note is not None:
        print(note, flush=True)
    return str(payload["sha256"]) if payload is not None else str(summary["sha256"])


def make_site_run(
    job: JobConfig,
    site: str,
    round_num: int,
    context: Context,
    *,
    argv: list[str],
    global_task_id: str | None = None,
    try_number: int | None = None,
) -> SiteRun:
    """The site job of (run, round, site), built by :func:`~flare_airflow.site_task.build.train_run`
    from what this task's context gives: the run, its parameters, the try, the verified digest of
    the input global model, this worker's trust settings.

    ``global_task_id`` names the task whose XCom holds the input global model's sha256 (the
    trainer verifies it). ``try_number``: the try that launches the job (default: this task's; a
    sensor watching a job another task launched passes that task's).
    """
    store = store_for(job)
    if try_number is None:
        try_number = try_number_of(context)
    global_sha256 = verified_global_sha256(context, job, site, round_num, global_task_id)
    trust = trust_settings().to_dict()
    params = run_params(context, job)
    return train_run(
        job,
        site,
        round_num,
        store=store,
        run_id=run_id_of(context),
        total_rounds=params.rounds,
        hparams=params.hparams,
        argv=argv,
        try_number=try_number,
        global_sha256=global_sha256,
        trust=trust,
    )


def make_evaluation_run(job: JobConfig, round_num: int, context: Context, *, global_model: str) -> SiteRun:
    """The server's evaluation of round ``round_num``'s global model, run by the aggregation task.

    The same trainer as the sites', as site :data:`SERVER_SITE`
    (:func:`~flare_airflow.site_task.build.evaluation_run`).
    """
    run_id = run_id_of(context)
    output = str(store_for(job).evaluation(job.job, run_id, round_num))
    params = run_params(context, job)
    return evaluation_run(
        job,
        SERVER_SITE,
        round_num,
        run_id=run_id,
        total_rounds=params.rounds,
        hparams=params.hparams,
        argv=trainer_argv(job),
        global_model=global_model,
        output=output,
    )


def try_number_of(context: Context) -> int:
    """This task's try (1 when the context has no task instance: a direct call)."""
    return int(getattr(context.get("ti"), "try_number", None) or 1)


def site_argv(job: JobConfig, site: str) -> list[str]:
    """The trainer's argv where the site runs it: this worker, an image, a cluster."""
    spec = job.sites[site]
    if spec.backend.argv == "image":
        return trainer_argv(job, spec.block)
    if spec.backend.argv == "cluster":
        return trainer_argv(job, cluster=spec.block)
    return trainer_argv(job)


def watchable(job: JobConfig, site: str) -> None:
    """Raise :class:`ConfigError` unless ``site``'s jobs can be watched by a sensor."""
    backend = job.sites[site].backend
    if not backend.watchable:
        titles = [b.title for b in BACKENDS.values() if b.watchable]
        others = ", ".join(titles[:-1]) + " and " + titles[-1]
        raise ConfigError(
            f"site {site!r}: a {backend.name} site job cannot be launched in one task and watched in another -- it "
            f"ends with the task that launched it (a {backend.name} job never outlives its task); use the fused site "
            f"task (watch: task) for {backend.name} sites; {others} sites can use watch: sensor"
        )


def site_launcher(
    job: JobConfig,
    site: str,
    *,
    try_number: int = 1,
    sink: Callable[[str], None] | None = None,
    hidden: Sequence[str] = (),
) -> JobLauncherSpec:
    """The site's launcher (launcher spec) on this worker, built by its backend's binding."""
    watchable(job, site)
    factory = binding(job.sites[site].launcher).launcher
    if factory is None:  # watchable() said it has one: the core entry and its binding disagree
        raise ConfigError(f"site {site!r}: backend {job.sites[site].launcher!r} has no launcher binding")
    return factory(job, site, try_number=try_number, sink=sink, hidden=hidden)
