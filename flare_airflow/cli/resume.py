"""Resume a federated run from its first round that did not complete (``flare-airflow resume``).

The right Clear, done for the operator: the first incomplete round's site tasks and aggregation,
every later round and publish are cleared; ``prepare`` and the completed rounds stay as they are,
their stored global models reused after checking them against the sha256 their tasks recorded
(never recomputed). The cleared tasks then run either

- in this process, the way ``airflow dags test`` runs a DAG (embedded default: SQLite, no
  scheduler). ``airflow dags test`` / ``DAG.test()`` cannot continue an existing run: it clears
  every task instance of the logical date and creates a run id of its own. So this module drives
  the existing run with the same loop and the same per-task runner ``DAG.test()`` uses; or
- by the running scheduler (detected by its heartbeat, or ``--scheduler``): the clear is written
  to the metadata database, the scheduler runs the tasks; the command waits unless ``--no-wait``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.model import read_artifact
from flare_airflow.operators.aggregate import AggregateOperator
from flare_airflow.operators.common import FINISHED_STATES, store_for
from flare_airflow.operators.prepare import PrepareRunOperator
from flare_airflow.operators.publish import PublishOperator
from flare_airflow.operators.site_job import SiteJobLaunchOperator
from flare_airflow.operators.verdict import RunVerdictOperator


class ResumeError(FlareAirflowError):
    """The run cannot be resumed as asked; the message says why and what to do."""


@dataclass(frozen=True)
class JobTasks:
    """A federated job's task ids in a DAG: prepare, each round's (aggregation, site tasks), publish."""

    prepare: str
    rounds: list[tuple[str, list[str]]]
    publish: str
    job: Any
    # A site watched by a sensor (watch: sensor): its site task id -> the task that launches its job.
    launches: dict[str, str] = field(default_factory=dict)
    # The run's verdict (a teardown deciding the run's state), cleared with publish; None in DAGs
    # built by versions without it.
    verdict: str | None = None

    @property
    def finish(self) -> list[str]:
        """publish and, after it, the verdict: what every resume clears last."""
        return [self.publish, *([self.verdict] if self.verdict else [])]

    def with_launches(self, task_ids: list[str]) -> list[str]:
        """``task_ids`` with, before each sensor-watched site task, its launch task: clearing the
        watch alone would watch the same finished job again instead of running the site again."""
        return [
            t
            for task_id in task_ids
            for t in ((self.launches[task_id],) if task_id in self.launches else ()) + (task_id,)
        ]

    @classmethod
    def of(cls, dag: Any) -> JobTasks:
        prepares = [t for t in dag.tasks if isinstance(t, PrepareRunOperator)]
        publishes = [t for t in dag.tasks if isinstance(t, PublishOperator)]
        if len(prepares) != 1 or len(publishes) != 1:
            raise ResumeError(
                f"DAG {dag.dag_id!r} holds {len(prepares)} federated job(s); resume handles a DAG with exactly one"
            )
        aggregates = sorted((t for t in dag.tasks if isinstance(t, AggregateOperator)), key=lambda t: t.round_num)
        rounds = [(a.task_id, sorted(a.site_task_ids.values())) for a in aggregates]
        launches = {
            downstream: t.task_id
            for t in dag.tasks
            if isinstance(t, SiteJobLaunchOperator)
            for downstream in t.downstream_task_ids
        }
        verdicts = [t.task_id for t in dag.tasks if isinstance(t, RunVerdictOperator)]
        return cls(
            prepare=prepares[0].task_id,
            rounds=rounds,
            publish=publishes[0].task_id,
            job=prepares[0].job,
            launches=launches,
            verdict=verdicts[0] if verdicts else None,
        )


@dataclass
class Plan:
    """What resume clears and keeps."""

    run_id: str
    rounds_requested: int
    from_round: int  # 0: prepare did not complete, the whole run starts again
    clear: list[str]
    kept: dict[int, str] = field(default_factory=dict)  # round -> sha256 of its kept global model
    nothing_to_do: bool = False


def _xcoms(dag_id: str, run_id: str, task_ids: list[str], session: Any) -> dict[str, Any]:
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    rows = session.scalars(
        select(XComModel).where(
            XComModel.dag_id == dag_id,
            XComModel.run_id == run_id,
            XComModel.task_id.in_(task_ids),
            XComModel.key == "return_value",
        )
    ).all()
    return {row.task_id: XComModel.deserialize_value(row) for row in rows}


def _states(dag_id: str, run_id: str, session: Any) -> dict[str, str | None]:
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import select

    tis = session.scalars(
        select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
    ).all()
    return {ti.task_id: (None if ti.state is None else str(getattr(ti.state, "value", ti.state))) for ti in tis}


def _kept_model(tasks: JobTasks, summary: Any) -> str | None:
    """The sha256 of a stored global model if it still matches its producer's XCom, else None."""
    if not isinstance(summary, dict) or not summary.get("global_uri") or not summary.get("sha256"):
        return None
    try:
        _, record = read_artifact(store_for(tasks.job).resolve_uri(summary["global_uri"]))
    except (FlareAirflowError, OSError):
        return None
    return record.sha256 if record.sha256 == summary["sha256"] else None


def make_plan(dag: Any, run_id: str, from_round: int | None, session: Any) -> Plan:
    """Which tasks to clear so that the run continues from ``from_round`` (default: the first round
    whose aggregation did not succeed with a verified global model)."""
    tasks = JobTasks.of(dag)
    states = _states(dag.dag_id, run_id, session)
    if not states:
        raise ResumeError(f"run {run_id!r} of DAG {dag.dag_id!r} has no task instances; is the run id right?")
    ids = [tasks.prepare, *(a for a, _ in tasks.rounds)]
    xcoms = _xcoms(dag.dag_id, run_id, ids, session)
    prepared = xcoms.get(tasks.prepare)
    kept: dict[int, str] = {}
    round0 = _kept_model(tasks, prepared) if states.get(tasks.prepare) == "success" else None
    if round0 is None:
        if from_round not in (None, 0, 1):
            raise ResumeError(
                f"prepare did not complete (or its round-0 model changed): the run can only start again "
                f"from the beginning; drop --from-round {from_round}"
            )
        every = [
            tasks.prepare,
            *(t for a, sites in tasks.rounds for t in (*tasks.with_launches(sites), a)),
            *tasks.finish,
        ]
        rounds = len(tasks.rounds)
        return Plan(run_id=run_id, rounds_requested=rounds, from_round=0, clear=every)
    kept[0] = round0
    requested = int(prepared["rounds"]) if isinstance(prepared, dict) else len(tasks.rounds)
    first_incomplete = requested + 1
    for r, (aggregate, _) in enumerate(tasks.rounds[:requested], start=1):
        summary = xcoms.get(aggregate)
        ok = states.get(aggregate) == "success" and isinstance(summary, dict) and summary.get("round") == r
        sha = _kept_model(tasks, summary) if ok else None
        if sha is None:
            first_incomplete = r
            break
        kept[r] = sha
    start = first_incomplete if from_round is None else from_round
    if not 1 <= start <= requested + 1 or start > first_incomplete:
        raise ResumeError(
            f"--from-round {start}: this run asked for {requested} round(s) and round {first_incomplete} is the "
            f"first without a verified global model; choose a round in 1..{min(first_incomplete, requested)}"
        )
    kept = {r: sha for r, sha in kept.items() if r < start}
    clear = [t for aggregate, sites in tasks.rounds[start - 1 :] for t in (*tasks.with_launches(sites), aggregate)]
    clear += tasks.finish
    done = start == requested + 1 and all(states.get(t) == "success" for t in tasks.finish)
    return Plan(run_id=run_id, rounds_requested=requested, from_round=start, clear=clear, kept=kept, nothing_to_do=done)


def clear_tasks(scheduler_dag: Any, run_id: str, task_ids: list[str], session: Any) -> None:
    """Clear exactly ``task_ids`` of the run (their XComs go when each runs again); the run is queued."""
    from airflow.utils.state import DagRunState

    scheduler_dag.clear(task_ids=task_ids, run_id=run_id, dag_run_state=DagRunState.QUEUED, session=session)
    session.commit()


def run_in_process(dag: Any, scheduler_dag: Any, run_id: str, session: Any, *, poll: float = 1.0) -> str:
    """Run a queued run's remaining tasks in this process until the run finishes; return its state.

    The loop of ``DAG.test()`` (Airflow 3.3, ``airflow/sdk/definitions/dag.py``) applied to an
    existing run: the run's dependencies decide what is schedulable, each task runs through the same
    in-process task runner (deferrable tasks' triggers run inline).
    """
    from airflow.models.dagrun import DagRun
    from airflow.sdk import timezone
    from airflow.sdk.definitions.dag import _run_task  # DAG.test()'s runner; private to Airflow 3.3
    from airflow.utils.state import DagRunState, TaskInstanceState
    from sqlalchemy import select

    dr = session.scalars(select(DagRun).where(DagRun.dag_id == dag.dag_id, DagRun.run_id == run_id)).one()
    dr.dag = scheduler_dag
    dr.state = DagRunState.RUNNING
    session.commit()
    while dr.state == DagRunState.RUNNING:
        session.expire_all()
        schedulable, _ = dr.update_state(session=session)
        for ti in schedulable:
            if ti.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                ti.try_number += 1
            ti.state = TaskInstanceState.SCHEDULED
            ti.scheduled_dttm = timezone.utcnow()
        session.commit()
        scheduled = [ti for ti in dr.get_task_instances(session=session) if ti.state == TaskInstanceState.SCHEDULED]
        if not scheduled and dr.state == DagRunState.RUNNING:
            time.sleep(poll)  # e.g. a site task waiting for its retry delay
        for ti in scheduled:
            _run_task(ti=ti, task=dag.task_dict[ti.task_id], run_triggerer=True)
    return str(dr.state.value if hasattr(dr.state, "value") else dr.state)


def scheduler_alive(session: Any) -> bool:
    """Whether a scheduler is heart-beating against this metadata database."""
    from airflow.jobs.job import most_recent_job

    job = most_recent_job("SchedulerJob", session=session)
    return bool(job is not None and job.is_alive())


def wait_for_run(dag_id: str, run_id: str, *, timeout: float, poll: float = 2.0) -> str:
    """Wait until the scheduler finished the run; return its final state."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    deadline = time.monotonic() + timeout
    while True:
        with create_session() as session:
            state = session.scalar(select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
        state = str(getattr(state, "value", state))
        if state in ("success", "failed"):
            return state
        if time.monotonic() > deadline:
            raise ResumeError(f"run {run_id!r} is still {state} after {timeout:.0f} s; the scheduler keeps running it")
        time.sleep(poll)


def round_verdicts(dag: Any, run_id: str, session: Any) -> list[str]:
    """One line per round and one for publish: what the run holds now."""
    tasks = JobTasks.of(dag)
    states = _states(dag.dag_id, run_id, session)
    xcoms = _xcoms(dag.dag_id, run_id, [a for a, _ in tasks.rounds] + [tasks.publish], session)
    lines = []
    for r, (aggregate, sites) in enumerate(tasks.rounds, start=1):
        state = states.get(aggregate) or "none"
        summary = xcoms.get(aggregate)
        site_states = [states.get(s) or "none" for s in sites]
        bad = sorted({s for s in site_states if s != "success"})
        detail = f"sites {site_states.count('success')}/{len(sites)} succeeded" + (
            f" ({', '.join(bad)} others)" if bad else ""
        )
        if state == "success" and isinstance(summary, dict):
            detail += f"; {len(summary.get('accepted', []))} counted; global model sha256 {summary['sha256'][:12]}…"
        lines.append(f"round {r}: {state:<15} {detail}")
    published = xcoms.get(tasks.publish)
    pub_state = states.get(tasks.publish) or "none"
    if pub_state == "success" and isinstance(published, dict):
        lines.append(f"publish: success      round {published['round']} model, sha256 {published['sha256'][:12]}…")
    else:
        lines.append(f"publish: {pub_state}")
    return lines


def unfinished(dag_id: str, run_id: str, session: Any) -> list[str]:
    """Task ids of the run that are neither finished nor waiting to be scheduled."""
    return sorted(t for t, s in _states(dag_id, run_id, session).items() if s is not None and s not in FINISHED_STATES)
