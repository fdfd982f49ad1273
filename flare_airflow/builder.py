"""Turn a job into Airflow work: a DAG, or a TaskGroup inside a DAG of your own.

Shape (one TaskGroup per round, one task per site and round)::

    prepare >> round_1.[site-1, site-2, ...] >> round_1.global_model
            >> round_2.[...] >> round_2.global_model >> ... >> publish

Site tasks are chosen by each site's launcher (process sites: a BashOperator-based task; k8s: a
KubernetesPodOperator; slurm: a deferrable batch-job task). Rounds
beyond the run's ``rounds`` form value are skipped, visibly, in the grid.
"""

from __future__ import annotations

import contextlib
import gc
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

from airflow.sdk import DAG, Param, TaskGroup

from flare_airflow.core.config import JobConfig, load_job
from flare_airflow.core.config.trainer import HparamRange
from flare_airflow.operators.aggregate import AggregateOperator
from flare_airflow.operators.bindings import binding, sweeps
from flare_airflow.operators.common import HPARAM_PREFIX, record_failures
from flare_airflow.operators.prepare import PrepareRunOperator
from flare_airflow.operators.publish import PublishOperator
from flare_airflow.operators.sweep import sweep_groups
from flare_airflow.operators.tracking_target import with_deployment_tracking
from flare_airflow.operators.verdict import RunVerdictOperator

AGGREGATE_TASK = "global_model"  # an underscore: can never collide with a site name (RFC 1123)
_PARAM_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _job(job: JobConfig | str | pathlib.Path) -> JobConfig:
    # A job file that leaves tracking out gets the deployment's default ([flare_airflow] tracking).
    return with_deployment_tracking(job if isinstance(job, JobConfig) else load_job(job))


def job_params(job: JobConfig) -> dict[str, Param]:
    """The trigger form: rounds, quorum, warm start and the trainer's hyper-parameters."""
    params: dict[str, Param] = {
        "rounds": Param(
            job.rounds,
            type="integer",
            minimum=1,
            maximum=job.rounds,
            title="Rounds",
            # Airflow 3.3's form (a NumberInput with min/max) moves an out-of-range value to the
            # nearest bound when the field loses focus, without a message: say the range here.
            description=f"Federated rounds to run: 1 to {job.rounds} (the form moves other values into this "
            "range); later rounds are skipped.",
        ),
        "min_clients": Param(
            job.min_clients,
            type="integer",
            minimum=1,
            maximum=len(job.sites),
            title="Minimum clients",
            # Not the site names: Airflow copies params into every task, so this text is stored
            # (sites x tasks) times in the serialized DAG.
            description=f"Valid site updates a round needs: 1 to {len(job.sites)}, the job's number of sites "
            "(the form moves other values into this range).",
        ),
        "warm_start": Param(
            job.warm_start,
            type="boolean",
            title="Warm start",
            description="Start from the final model of this job's last successful run.",
        ),
    }
    if job.on_data is not None:
        params["sites"] = Param(
            [],
            type="array",
            items={"type": "string", "enum": list(job.sites)},
            title="Sites",
            description="The sites this run trains on, one per line; empty: every site. A run started by the "
            "sites' data trains on the fresh sites.",
        )
    for key, value in job.trainer.hparams.items():
        params[HPARAM_PREFIX + key] = _hparam_param(key, value, job.trainer.hparam_ranges.get(key))
    return params


def _hparam_param(key: str, value: Any, bounds: HparamRange | None) -> Param:
    """A trigger form field for one hyper-parameter.

    A float gets a one-line text field that keeps what was typed, key by key. Airflow 3.3 gives a
    ``number`` param a number field that reads ``1e-3`` as 13, and a param of several types (no
    ``examples``) a JSON box that re-reads its text at each keystroke: typed ``0.001`` became
    ``001`` (``0.0`` reads as 0, then ``00``, ``001`` stay text). Type ``["string", "number"]``
    with ``examples`` is Airflow's plain text input (the examples are its suggestions); a number
    (JSON, the REST API) is still accepted. Neither a pattern nor the range goes into the schema:
    Airflow would refuse with its JSON-schema dump, while ``prepare`` refuses before any site trains
    with a sentence (:func:`~flare_airflow.core.config.validators.hparam_value`), whatever carried
    the value.
    """
    about = f"Trainer hyper-parameter {key!r} (flare.get_hparams()['{key}'])"
    bounds_schema: dict[str, Any] = {}
    if bounds is not None and not isinstance(value, bool):
        as_type = int if isinstance(value, int) else float
        low = None if bounds.min is None else as_type(bounds.min)
        high = None if bounds.max is None else as_type(bounds.max)
        if low is not None:
            bounds_schema["minimum"] = low
        if high is not None:
            bounds_schema["maximum"] = high
        about += f"; allowed: {'' if low is None else f'{low!r} <= '}{key}{'' if high is None else f' <= {high!r}'}"
    if isinstance(value, float):
        return Param(
            value,
            type=["string", "number"],
            examples=[repr(value)],
            title=key,
            description=f"{about}. A number as you write it, e.g. 0.001 or 1e-3.",
            section="Trainer hyper-parameters",
        )
    return Param(
        value,
        type=_PARAM_TYPES[type(value)],
        title=key,
        description=f"{about}.",
        section="Trainer hyper-parameters",
        **bounds_schema,
    )


def site_task(job: JobConfig, site: str, round_num: int, **kwargs: Any) -> Any:
    """The site's task for one round, chosen by the site's launcher (site policy, not the DAG's):
    its backend's fused site-task class, imported only when a job has such a site."""
    operator = binding(job.sites[site].launcher).site_task
    return operator(job=job, site=site, round_num=round_num, **kwargs)


LAUNCH_SUFFIX = "_launch"  # an underscore: never part of a site name, so never a site's task id


def site_tasks(job: JobConfig, site: str, round_num: int, **kwargs: Any) -> tuple[Any, Any]:
    """The site's task(s) for one round: ``(first, last)``; the last one returns the update's summary.

    ``watch: task`` (default): one task launches and waits. ``watch: sensor``: ``<site>_launch``
    (:class:`SiteJobLaunchOperator`) then ``<site>`` (:class:`SiteJobSensor`, which publishes).
    """
    if job.sites[site].watch != "sensor":
        task = site_task(job, site, round_num, **kwargs)
        return task, task
    from flare_airflow.operators.site_job import SiteJobLaunchOperator
    from flare_airflow.sensors.site_job import SiteJobSensor

    task_id = kwargs.pop("task_id")
    doc_md = kwargs.pop("doc_md", None)
    launch = SiteJobLaunchOperator(
        job=job,
        site=site,
        round_num=round_num,
        task_id=task_id + LAUNCH_SUFFIX,
        doc_md=f"Launch: {doc_md}" if doc_md else None,
        **kwargs,
    )
    kwargs.pop("global_task_id", None)
    watch = SiteJobSensor(
        job=job,
        site=site,
        round_num=round_num,
        launch_task_id=launch.task_id,
        task_id=task_id,
        doc_md=f"Watch: {doc_md}" if doc_md else None,
        **kwargs,
    )
    launch >> watch
    return launch, watch


def running_site(job: JobConfig, dag_id: str | None) -> str | None:
    """The site whose task this process runs, when Airflow parses the DAG to run one task of it.

    A task process re-parses its DAG file before it runs (Airflow's parsing context names the
    DAG and task). For a site task only that site's tasks are needed, next to the run's own tasks
    (prepare, each round's aggregation, publish): building the other N-1 sites' tasks in each of
    the N site tasks made a round's CPU grow with N^2 (benchmarks/results/scale.md). Every other
    parse -- the dag-processor's, ``airflow dags test``, the aggregation's task -- builds the whole DAG.
    """
    from airflow.sdk import get_parsing_context

    context = get_parsing_context()
    if context.task_id is None or dag_id is None or context.dag_id != dag_id:
        return None
    name = context.task_id.rsplit(".", 1)[-1].removesuffix(LAUNCH_SUFFIX)
    return name if name in job.sites else None


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Building thousands of operators allocates millions of objects, none of them garbage: the
    collector's passes over the heap (Airflow's is large) took a third of a 1024-site build."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def add_rounds(job: JobConfig, only_site: str | None = None) -> tuple[PrepareRunOperator, PublishOperator]:
    """Create the job's tasks in the current DAG / TaskGroup context; return the first and last.

    ``only_site``: build that site's tasks only (see :func:`running_site`).
    """
    prepare = PrepareRunOperator(
        task_id="prepare", job=job, doc_md=f"Round-0 global model of job `{job.job}`; the sites this run trains on."
    )
    previous: Any = prepare
    aggregates = []
    tasks: list[Any] = []  # every task made here
    built = [only_site] if only_site is not None else list(job.sites)
    for r in range(1, job.rounds + 1):
        with TaskGroup(
            group_id=f"round_{r}", tooltip=f"round {r}: {len(job.sites)} site jobs, then {job.aggregator.label}"
        ):
            pairs = [
                site_tasks(
                    job, site, r, task_id=site, global_task_id=previous.task_id, doc_md=f"Site `{site}`, round {r}."
                )
                for site in built
            ]
            sites = [last for _, last in pairs]
            tasks += [task for pair in pairs for task in pair]  # (task, task) under watch: task
            aggregate = AggregateOperator(
                task_id=AGGREGATE_TASK,
                job=job,
                round_num=r,
                site_task_ids={site: task.task_id for site, task in zip(built, sites, strict=True)},
                global_task_id=previous.task_id,
                prepare_task_id=prepare.task_id,
                doc_md=f"{job.aggregator.label} of round {r}; evaluation.",
            )
            sites >> aggregate
        previous >> [first for first, _ in pairs]
        previous = aggregate
        aggregates.append(aggregate)
    publish = PublishOperator(
        task_id="publish",
        job=job,
        aggregate_task_ids=[a.task_id for a in aggregates],
        prepare_task_id=prepare.task_id,
        doc_md="Final model, metrics, the data it was trained on.",
    )
    aggregates >> publish
    verdict = RunVerdictOperator(
        task_id="verdict",
        job=job,
        prepare_task_id=prepare.task_id,
        aggregate_task_ids=[a.task_id for a in aggregates],
        publish_task_id=publish.task_id,
        doc_md="The run's state: success only when publish published this run's model (see docs/when-things-fail.md).",
    )
    # A teardown that fails the run: Mark run as failed does not skip it and its failure is the run's.
    publish >> verdict.as_teardown(on_failure_fail_dagrun=True)
    tasks += [prepare, *aggregates, publish, verdict]
    for task_id, sweep_cls in sweeps(job.sites):
        for sweep_id, sites, where in sweep_groups(job, sweep_cls, task_id):
            # A teardown: runs when everything else is done, failed runs included, and does not
            # change the run's outcome.
            sweep = sweep_cls(task_id=sweep_id, job=job, sites=sites, doc_md=sweep_cls.sweep_doc, **where)
            publish >> sweep.as_teardown()
            tasks.append(sweep)
    record_failures(tasks)
    return prepare, publish


def federated_task_group(job: JobConfig | str | pathlib.Path, group_id: str | None = None) -> TaskGroup:
    """A TaskGroup running the job inside the current DAG. Run parameters come from the DAG's
    params when present (see :func:`job_params`), else from the job's defaults."""
    cfg = _job(job)
    with (
        _gc_paused(),
        TaskGroup(group_id=group_id or cfg.job.replace("-", "_"), tooltip=f"federated job {cfg.job}") as group,
    ):
        add_rounds(cfg, running_site(cfg, group.dag.dag_id if group.dag else None))
    return group


def data_schedule(job: JobConfig) -> Any:
    """Airflow's own partitioned-asset schedule for ``trigger: {on_data: ...}``.

    The sites' announcements are one asset partitioned by site name; a categorical rollup (all
    of them onto one key, the job's sites as the window) fires a run once ``min_sites`` of the
    job's sites announced (``MinimumCount``). Airflow keeps the announcements a run consumed with
    it (``triggering_asset_events``), counts a site once however often it announced, and queues
    announcements after the run for the next one. What it does not do -- the signature check and
    the freshness window -- ``prepare`` does (:func:`flare_airflow.core.data_ready.fresh_sites`).
    """
    from airflow.sdk import FixedKeyMapper, MinimumCount, PartitionedAssetTimetable, RollupMapper, SegmentWindow

    from flare_airflow.operators.data_ready import site_data_asset

    assert job.on_data is not None
    return PartitionedAssetTimetable(
        assets=site_data_asset(),
        default_partition_mapper=RollupMapper(
            upstream_mapper=FixedKeyMapper(job.job),
            window=SegmentWindow(list(job.sites)),
            wait_policy=MinimumCount(job.on_data.min_sites),
        ),
    )


def _job_doc(cfg: JobConfig, job: JobConfig | str | pathlib.Path) -> str:
    """Markdown for the DAG's Docs tab: the summary, the sites, and the job file it was built from."""
    lines = [
        f"Federated job **{cfg.job}**: {cfg.rounds} rounds of {cfg.aggregator.label} over {len(cfg.sites)} sites "
        f"({', '.join(cfg.sites)}), quorum {cfg.min_clients}.",
    ]
    if not isinstance(job, JobConfig):
        path = pathlib.Path(job)
        try:
            text = path.read_text()
        except OSError:
            text = ""
        if text and len(text) <= _MAX_DOC_YAML:
            lines += ["", f"Job file `{path.name}`:", "", "```yaml", text.rstrip(), "```"]
    return "\n".join(lines)


_MAX_DOC_YAML = 20_000  # a 1024-site job file is not shown: Airflow stores doc_md in the serialized DAG


def build_dag(
    job: JobConfig | str | pathlib.Path,
    *,
    dag_id: str | None = None,
    default_args: Mapping[str, Any] | None = None,
    **dag_kwargs: Any,
) -> DAG:
    """A DAG for the job: trigger form from :func:`job_params`, schedule from the job unless given."""
    cfg = _job(job)
    # With on_data a job's `schedule` is the data watch's fallback, not the DAG's schedule; a DAG
    # given a schedule of its own (e.g. None: by hand only) gets no watch.
    watched = cfg.on_data is not None and "schedule" not in dag_kwargs
    dag_kwargs.setdefault("schedule", data_schedule(cfg) if cfg.on_data is not None else cfg.schedule)
    dag_kwargs.setdefault("max_active_runs", 1)  # warm starts read the previous run's result
    dag_kwargs.setdefault("catchup", False)
    dag_kwargs.setdefault("tags", ["federated-learning", f"job:{cfg.job}"])
    summary = (
        f"Federated job {cfg.job}: {cfg.rounds} rounds of {cfg.aggregator.label} over {len(cfg.sites)} sites, "
        f"quorum {cfg.min_clients}"
    )
    if cfg.on_data is not None:
        summary += (
            f"; runs when {cfg.on_data.min_sites} of its {len(cfg.sites)} sites announced fresh data "
            f"(window {cfg.on_data.window})"
        )
        if cfg.on_data.wait is not None:
            summary += f"; after {cfg.on_data.wait} with at least {cfg.min_clients}"
        if cfg.schedule is not None:
            summary += f"; fallback {cfg.schedule}"
    # The DAG list shows `description`; the DAG's Docs tab shows `doc_md`: what the DAG runs.
    dag_kwargs.setdefault("description", summary[:200])
    dag_kwargs.setdefault("doc_md", _job_doc(cfg, job))
    params = {**job_params(cfg), **dict(dag_kwargs.pop("params", {}) or {})}
    task_defaults = dict(default_args or {})
    params.update(task_defaults.pop("params", None) or {})  # as DAG(default_args={"params": ...}) merges them
    with (
        _gc_paused(),
        DAG(dag_id=dag_id or f"flare_{cfg.job.replace('-', '_')}", default_args=task_defaults, **dag_kwargs) as dag,
    ):
        add_rounds(cfg, running_site(cfg, dag.dag_id))
    # The form goes on the DAG once its tasks exist. A task created inside a DAG that has params
    # gets its own deep copy of them, which Airflow serialises -- and validates against each Param's
    # JSON schema -- task by task: 60 % of a site task's serialized bytes and 95 % of the 1024-site
    # DAG's serialization time (benchmarks/results/scale.md). Tasks without params of their own get
    # the DAG's at run time (the Task SDK merges DAG and task params), so what a task sees is unchanged.
    dag.params = params  # type: ignore[assignment]  # DAG's converter makes the ParamsDict and validates it
    if watched and cfg.on_data is not None and (cfg.on_data.wait is not None or cfg.schedule is not None):
        data_watch_dag(cfg, dag.dag_id)
    return dag


def data_watch_dag(job: JobConfig, dag_id: str) -> DAG:
    """The companion DAG ``<dag_id>_data_watch`` of ``trigger.on_data.wait`` and a cron fallback
    (:mod:`flare_airflow.operators.data_watch`). Made in a ``with`` block, Airflow registers it
    from the job's DAG file next to the job's DAG."""
    from flare_airflow.core.data_ready import WATCH_SUFFIX
    from flare_airflow.operators.data_watch import DataWatchOperator, watch_interval

    assert job.on_data is not None
    with DAG(
        dag_id=dag_id + WATCH_SUFFIX,
        schedule=watch_interval(job),
        catchup=False,
        max_active_runs=1,
        tags=["federated-learning", f"job:{job.job}", "data-watch"],
        description=f"Starts {dag_id} over the fresh sites when the wait expires or the schedule's fallback is due",
    ) as watch:
        DataWatchOperator(task_id="decide", job=job, watched_dag_id=dag_id)
    return watch
