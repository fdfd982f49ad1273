"""What every flare-airflow task needs from its context: the store, the run's parameters."""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from airflow.sdk import ObjectStoragePath
from airflow.sdk.exceptions import AirflowFailException, AirflowInactiveAssetInInletOrOutletException

from flare_airflow.core.config import JobConfig, short_repr
from flare_airflow.core.config.validators import hparam_value
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import ModelStore

HPARAM_PREFIX = "hp_"


class RunParamsError(FlareAirflowError):
    """The run's form values (DAG params) are invalid for this job."""


def default_store_uri() -> str:
    home = os.path.expanduser(os.environ.get("AIRFLOW_HOME", "~/airflow"))
    return "file://" + os.path.join(os.path.abspath(home), "flare_store")


def store_for(job: JobConfig, conn_id: str | None = None) -> ModelStore:
    """The job's model store on Airflow's ObjectStoragePath (file:// under AIRFLOW_HOME by default),
    reached through the Airflow connection ``conn_id`` (a site's own), else the job's ``store_conn_id``."""
    uri = job.store or default_store_uri()
    if "://" not in uri:
        uri = "file://" + str(job.resolve(uri))
    return ModelStore(ObjectStoragePath(uri, conn_id=conn_id or job.store_conn_id))


@dataclass(frozen=True)
class RunParams:
    """The values an operator chose in the trigger form (or the job's defaults)."""

    rounds: int
    min_clients: int
    warm_start: bool
    hparams: dict[str, Any]
    # Why the run trains fewer rounds than asked: the job's privacy budget (max_epsilon) ends it first.
    budget_note: str | None = None
    # The sites this run trains on, chosen in the form; None: every site (or, in a run started by
    # the sites' data, the fresh ones).
    sites: tuple[str, ...] | None = None


RUN_PARAMS = ("rounds", "min_clients", "warm_start")
DATA_RUN_PARAMS = ("sites",)  # jobs with trigger.on_data: the form's Sites field


def allowed_run_keys(job: JobConfig) -> list[str]:
    """The trigger conf keys a run of ``job`` understands."""
    data = DATA_RUN_PARAMS if job.on_data is not None else ()
    return [*RUN_PARAMS, *data, *(HPARAM_PREFIX + key for key in job.trainer.hparams)]


def _suggest(key: str, allowed: list[str]) -> str | None:
    if HPARAM_PREFIX + key in allowed:  # a hyper-parameter given without the form's prefix
        return HPARAM_PREFIX + key
    close = difflib.get_close_matches(key, allowed, 1)
    return close[0] if close else None


def _integer(value: Any, name: str, low: int, high: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RunParamsError(f"{name} must be an integer in {low}..{high} ({why}), got {short_repr(value)}")
    if not low <= value <= high:
        raise RunParamsError(f"{name}={short_repr(value)} is outside {low}..{high} ({why})")
    return value


def _hparam(job: JobConfig, key: str, default: Any, value: Any) -> Any:
    """A form value for a hyper-parameter: the type of the job's default, finite, in its range."""
    try:
        return hparam_value(HPARAM_PREFIX + key, default, value, job.trainer.hparam_ranges.get(key))
    except ValueError as exc:
        raise RunParamsError(str(exc)) from None


def run_params(context: Mapping[str, Any], job: JobConfig) -> RunParams:
    """The run's form values, checked: unknown keys (a typo such as ``round``) are refused.

    The trigger conf (``dag_run.conf``) may hold only this job's run parameters and the DAG's own
    params (for a TaskGroup inside a DAG of your own); values must have the form's types.
    """
    params: Mapping[str, Any] = context.get("params") or {}
    conf = getattr(context.get("dag_run"), "conf", None) or {}
    if not isinstance(conf, Mapping):
        raise RunParamsError(f"the trigger conf must be a JSON object, got {short_repr(conf)}")
    allowed = allowed_run_keys(job)
    declared = set(getattr(context.get("dag"), "params", None) or {})
    unknown = [str(k) for k in conf if k not in allowed and k not in declared]
    if unknown:
        named = [f"{k!r} (did you mean {m!r}?)" if (m := _suggest(k, allowed)) else repr(k) for k in unknown]
        raise RunParamsError(f"unknown run parameter(s) {', '.join(named)[:300]}; allowed: {', '.join(allowed)}")
    rounds = _integer(params.get("rounds", job.rounds), "rounds", 1, job.rounds, "the job's configured maximum")
    min_clients = _integer(
        params.get("min_clients", job.min_clients), "min_clients", 1, len(job.sites), "the job's number of sites"
    )
    problem = job.aggregator.quorum_problem(min_clients, len(job.sites))
    if problem is not None:
        raise RunParamsError(f"min_clients={min_clients}: {problem}")
    warm_start = params.get("warm_start", job.warm_start)
    if not isinstance(warm_start, bool):
        raise RunParamsError(f"warm_start must be true or false, got {short_repr(warm_start)}")
    hparams = dict(job.trainer.hparams)
    for key, default in job.trainer.hparams.items():
        if HPARAM_PREFIX + key in params:
            hparams[key] = _hparam(job, key, default, params[HPARAM_PREFIX + key])
    sites = _sites(job, params.get("sites")) if job.on_data is not None else None
    # The budget is known before the run (the job's own noise and δ): the rounds beyond it are
    # skipped like rounds the form did not ask for, and the run publishes what it trained.
    return RunParams(
        rounds=job.privacy.rounds_allowed(rounds),
        min_clients=min_clients,
        warm_start=warm_start,
        hparams=hparams,
        budget_note=job.privacy.budget_note(rounds),
        sites=sites,
    )


def sat_out_sites(context: Mapping[str, Any], prepare_task_id: str | None) -> dict[str, str]:
    """Site -> why it sits this run out (not fresh, not chosen), as ``prepare`` decided."""
    if prepare_task_id is None:
        return {}
    prepared = context["ti"].xcom_pull(task_ids=prepare_task_id)
    sat_out = prepared.get("sat_out") if isinstance(prepared, Mapping) else None
    return {str(k): str(v) for k, v in sat_out.items()} if isinstance(sat_out, Mapping) else {}


def _sites(job: JobConfig, value: Any) -> tuple[str, ...] | None:
    """The form's ``sites``: a list of the job's site names; empty or absent: every site."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RunParamsError(f"sites must be a list of site names, got {short_repr(value)}")
    unknown = [v for v in value if v not in job.sites]
    if unknown:
        raise RunParamsError(
            f"sites: {', '.join(map(repr, unknown))[:200]} not in job {job.job!r} "
            f"(its sites: {', '.join(job.sites)[:300]})"
        )
    if len(set(value)) != len(value):
        raise RunParamsError(f"sites names a site twice: {short_repr(value)}")
    return tuple(value)


def run_id_of(context: Mapping[str, Any]) -> str:
    return str(context["run_id"])


# A task in one of these states will not run again unless someone clears it.
FINISHED_STATES = frozenset({"success", "failed", "upstream_failed", "skipped", "removed"})


def task_states(context: Mapping[str, Any], task_ids: list[str]) -> dict[str, str | None]:
    """This run's current state of each of ``task_ids`` (None: cleared or not scheduled yet).

    Read through the Task SDK (tasks cannot use the ORM); an empty answer where the SDK has no
    such call (a task run outside Airflow).
    """
    ti: Any = context.get("ti")
    get = getattr(ti, "get_task_states", None)
    if get is None or not task_ids:
        return {}
    by_run = get(dag_id=ti.dag_id, task_ids=list(task_ids), run_ids=[ti.run_id]) or {}
    found = by_run.get(ti.run_id, {})
    return {t: (None if (s := found.get(t)) is None else str(getattr(s, "value", s))) for t in task_ids}


FAILURE_XCOM_KEY = "failure"


def push_failure(context: Mapping[str, Any], reason: str) -> None:
    """Leave why a task failed in its XCom (key ``failure``): the aggregation reads the sites',
    ``flare-airflow run`` prints them. Best effort: the task fails with the reason anyway."""
    ti: Any = context.get("ti")
    if hasattr(ti, "xcom_push"):
        with contextlib.suppress(Exception):
            ti.xcom_push(key=FAILURE_XCOM_KEY, value=reason[:4000])


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, AirflowInactiveAssetInInletOrOutletException):
        text += (
            " -- Airflow keeps one active Asset per name and per URI, and another Asset with this name is "
            "active: a DAG that declares it with another URI (schedule on Asset(name=...) or Asset.ref(name=...) "
            "instead), or one an older flare-airflow declared with the store's path. A running scheduler retires "
            "Assets no DAG references within [scheduler] parsing_cleanup_interval; then run again"
        )
    return text


def record_failure(context: Mapping[str, Any]) -> None:
    """``on_failure_callback`` of every task the builder makes: a failure that left no reason in XCom
    -- Airflow's own checks before ``execute`` (an inactive outlet Asset, a template that does not
    render), or an error that no handler of ours turned into a reason -- leaves the exception's text
    there (:func:`push_failure`), so ``flare-airflow run`` never says "no reason recorded" for it."""
    exc, ti = context.get("exception"), context.get("ti")
    if not isinstance(exc, BaseException) or ti is None:
        return
    with contextlib.suppress(Exception):  # a callback must not fail the task's failure handling
        if ti.xcom_pull(task_ids=ti.task_id, key=FAILURE_XCOM_KEY) is None:
            push_failure(context, _reason(exc))


def record_failures(tasks: Iterable[Any]) -> None:
    """Add :func:`record_failure` to each task's ``on_failure_callback`` once (kept: callbacks from
    the DAG's ``default_args``)."""
    for task in tasks:
        existing = task.on_failure_callback
        callbacks = list(existing) if isinstance(existing, list | tuple) else [existing] if existing else []
        if record_failure not in callbacks:
            task.on_failure_callback = [*callbacks, record_failure]


_Op = TypeVar("_Op")


def failure_to_xcom(execute: Callable[[_Op, Any], Any]) -> Callable[[_Op, Any], Any]:
    """Decorate an operator's ``execute``: the reason of an ``AirflowFailException`` it raises also
    goes to XCom (:func:`push_failure`), where ``flare-airflow run`` and later tasks find it."""

    @functools.wraps(execute)
    def wrapper(self: _Op, context: Any) -> Any:
        try:
            return execute(self, context)
        except AirflowFailException as exc:
            push_failure(context, str(exc))
            raise

    return wrapper
