"""``flare-airflow``: validate jobs, try a trainer, run a federated DAG and check every task, resume, reports.

``flare-airflow run DAG_ID`` runs Airflow's own ``airflow dags test`` command (which exits 0 even
when a task failed) in this process and then reads every task instance's final state from the
metadata database: it exits non-zero unless the run and all of its tasks succeeded (or were skipped
on purpose). In-process, not a subprocess: Airflow is imported once (a second interpreter importing
Airflow again for the state check cost ~3.6 s of every run).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from flare_airflow.cli.dag_runs import (
    DAG_RUN_FAILED,
    OK_STATES,
    CLIError,
    _output_to,
    dag_import_errors,
    dags_test,
    latest_run_key,
    open_log,
    run_state,
    write_task_logs,
)
from flare_airflow.cli.doctor import add_parser as add_doctor_parser
from flare_airflow.cli.keys import add_parsers as add_trust_parsers
from flare_airflow.core.config import check_store_backend, load_initial_model, load_job
from flare_airflow.core.errors import ConfigError, FlareAirflowError
from flare_airflow.core.report import format_table, read_metrics

__all__ = ["console", "main"]


def _cmd_validate(args: argparse.Namespace) -> int:
    """Refuse what a run would refuse: the job file, its initial model and its store's backend."""
    try:
        job = load_job(args.job)
        load_initial_model(job)
        check_store_backend(job)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"job {job.job!r}: {job.rounds} rounds, min_clients {job.min_clients}, trainer {job.script_path()}")
    for name, site in job.sites.items():
        gpus = f"{site.resource_spec.num_of_gpus} GPU(s)"
        if site.nodes > 1:  # what the site's pool gives one site job
            gpus = f"{site.nodes} nodes x {gpus} = {site.gpus_per_job} GPU(s)"
        print(f"  site {name}: launcher {site.launcher}, {gpus}, weight {site.weight:g}, retries {site.retries}")
    return 0


def _print_states(state: dict[str, Any]) -> None:
    groups: dict[str, list[str]] = {}
    for task_id, info in sorted(state["tasks"].items()):
        group, _, name = task_id.rpartition(".")
        groups.setdefault(group or "-", []).append(f"{name or task_id}={info['state']}")
    for group, items in groups.items():
        print(f"  {group:>10}: {', '.join(items)}")


def _with_log(command: Callable[[argparse.Namespace, int, str], int]) -> Callable[[argparse.Namespace], int]:
    """Run ``command`` with this run's private log file open (see ``open_log``), closed after."""

    def run(args: argparse.Namespace) -> int:
        log_fd, log_path = open_log(args.log, args.dag_id)
        try:
            return command(args, log_fd, log_path)
        finally:
            os.close(log_fd)

    return run


def _run(args: argparse.Namespace, log_fd: int, log_path: str) -> int:
    print(
        f"running {args.dag_id} through Airflow (airflow dags test); its output: {log_path}",
        file=sys.stderr if args.json else sys.stdout,
        flush=True,
    )
    started = time.monotonic()
    import_errors: dict[str, str] = {}
    with _output_to(log_fd):
        try:
            before = latest_run_key(args.dag_id)
        except Exception as exc:  # no metadata database yet, or an unreadable one; traceback to the log
            traceback.print_exc()
            unreadable = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        else:
            unreadable = ""
            returncode, error = dags_test(args.dag_id, dagfile=args.dagfile, conf=args.conf)
            if error and error != DAG_RUN_FAILED:
                # Airflow stopped before or without running the DAG. Its reason ("could not be found", or
                # a ValueError of its own about the DAG file's path while it looked for the DAG among
                # the example DAGs) is not the user's problem when the DAG file failed to import (e.g.
                # a job's ConfigError): that one is shown first.
                import_errors = dag_import_errors(args.dagfile)
    if unreadable:
        print(
            f"error: cannot read Airflow's metadata database ({unreadable}); create it with `airflow db migrate` "
            f"(`make setup` does) and check AIRFLOW_HOME; see {log_path}",
            file=sys.stderr,
        )
        return 1
    elapsed = time.monotonic() - started
    if import_errors:
        print(f"error: DAG {args.dag_id!r} was not loaded; DAG files that failed to import:", file=sys.stderr)
        for path, text in import_errors.items():
            print(f"  {path}:\n    " + text.replace("\n", "\n    "), file=sys.stderr)
        print(f"(Airflow's output: {log_path})", file=sys.stderr)
        return 1
    if "ParamValidationError:" in error:
        detail = error.split("ParamValidationError:", 1)[1].strip().splitlines()[0]
        print(
            f"error: --conf refused before a run was created: {detail}; the trigger form's fields and their ranges "
            "are in docs/dag-authors.md (The trigger form)",
            file=sys.stderr,
        )
        return 2
    try:
        state = run_state(args.dag_id, newer_than=before)
    except FlareAirflowError as exc:
        why = f" ({error})" if error else ""
        print(f"error: {exc}; `airflow dags test` exited {returncode}{why}; see {log_path}", file=sys.stderr)
        return 1
    state["wall_seconds"] = round(elapsed, 2)
    task_logs = write_task_logs(log_path, state)
    if task_logs:
        state["task_logs"] = task_logs
    if args.json:
        print(json.dumps(state, indent=2, sort_keys=True))
    else:
        print(f"run {state['run_id']}: {state['state']} in {elapsed:.1f}s")
        if task_logs:
            print(f"task logs (one file per task try, as the Airflow UI shows them): {task_logs}")
        _print_states(state)
        published = state.get("published")
        if published:
            _print_report(published["metrics"])
            print(f"final model: {published['final_model']}")
            print(f"metrics:     {published['metrics']}")
            print(f"plot:        {published['plot']}")
    return _verdict(state, log_path)


def _verdict(state: dict[str, Any], log_path: str) -> int:
    """0 for a run that succeeded and published, whatever site failures its quorum absorbed; 1
    otherwise. Either way every task that did not succeed is listed with its reason."""
    bad = {t: i for t, i in state["tasks"].items() if i["state"] not in OK_STATES}
    ok = state["state"] == "success" and state.get("published") is not None
    if ok and bad:
        print("site failures the quorum absorbed (the run succeeded without them):", file=sys.stderr)
    elif not ok:
        print(f"FAILED: run {state['run_id']} ended {state['state']}; see {log_path}", file=sys.stderr)
    failed = {t: i for t, i in bad.items() if i["state"] == "failed"}

    # prepare (nothing ran), then the failing aggregation (its reason names the round and every
    # failed site), then sites.
    def order(task_id: str) -> tuple[int, str]:
        return (0 if task_id.endswith("prepare") else 1 if task_id.endswith("global_model") else 2, task_id)

    for task_id, info in sorted(failed.items(), key=lambda kv: order(kv[0])):
        print(f"  {task_id}: {info.get('reason') or 'no reason recorded (see the log)'}", file=sys.stderr)
    not_run = sorted(t for t in bad if t not in failed)
    if not_run:
        print(f"  not run because of that ({len(not_run)}): {', '.join(not_run)}", file=sys.stderr)
    if not ok and not bad:
        print("  no task failed, but nothing was published (a Clear that did not reach publish?)", file=sys.stderr)
    return 0 if ok else 1


def _resume(args: argparse.Namespace, log_fd: int, log_path: str) -> int:
    """Clear what the run needs from its first incomplete round on, run it, print per-round verdicts."""
    from airflow import settings
    from airflow.configuration import write_default_airflow_configuration_if_needed
    from airflow.models.dagrun import DagRun
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.cli import get_bagged_dag
    from sqlalchemy import select

    from flare_airflow.cli import resume

    print(f"resuming {args.dag_id} run {args.run_id}; its output: {log_path}", flush=True)
    with _output_to(log_fd):
        write_default_airflow_configuration_if_needed()
        try:
            dag = get_bagged_dag(None, args.dag_id, os.path.abspath(args.dagfile) if args.dagfile else None)
        except Exception as exc:  # a DAG that is missing or does not parse: the traceback goes to the log
            traceback.print_exc()
            raise CLIError(f"DAG {args.dag_id!r} could not be loaded ({type(exc).__name__}); see {log_path}") from None
    if settings.Session is None:
        raise CLIError("Airflow's metadata database is not configured; check AIRFLOW_HOME")
    session = settings.Session()
    dag_run = session.scalars(select(DagRun).where(DagRun.dag_id == args.dag_id, DagRun.run_id == args.run_id)).first()
    if dag_run is None:
        raise CLIError(
            f"DAG {args.dag_id!r} has no run {args.run_id!r} (list them: `airflow dags list-runs {args.dag_id}`)"
        )
    if str(dag_run.state) in ("running", "queued"):
        raise CLIError(
            f"run {args.run_id!r} is still {dag_run.state}; wait for it to end (or mark it failed), then resume"
        )
    plan = resume.make_plan(dag, args.run_id, args.from_round, session)
    if plan.nothing_to_do and str(dag_run.state) == "success":
        print(f"run {args.run_id}: all {plan.rounds_requested} requested round(s) done and published; nothing to do")
        for line in resume.round_verdicts(dag, args.run_id, session):
            print(f"  {line}")
        return 0
    kept = ", ".join(f"round {r} {sha[:12]}…" for r, sha in sorted(plan.kept.items())) or "nothing"
    start = "the beginning (prepare did not complete)" if plan.from_round == 0 else f"round {plan.from_round}"
    print(f"from {start} of {plan.rounds_requested}; keeping the verified global models of {kept}")
    print(f"clearing {len(plan.clear)} task(s): {', '.join(plan.clear)}", flush=True)
    use_scheduler = args.scheduler or (not args.in_process and resume.scheduler_alive(session))
    scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    started = time.monotonic()
    with _output_to(log_fd):
        resume.clear_tasks(scheduler_dag, args.run_id, plan.clear, session)
        if not use_scheduler:
            state = resume.run_in_process(dag, scheduler_dag, args.run_id, session)
    if use_scheduler:
        if args.no_wait:
            print("cleared; the scheduler runs it (not waiting: --no-wait)")
            return 0
        print("cleared; a scheduler is running: waiting for it to finish the run", flush=True)
        state = resume.wait_for_run(args.dag_id, args.run_id, timeout=args.timeout)
    session.expire_all()
    print(f"run {args.run_id}: {state} in {time.monotonic() - started:.1f}s")
    for line in resume.round_verdicts(dag, args.run_id, session):
        print(f"  {line}")
    final = run_state(args.dag_id, args.run_id)
    published = final.get("published") or {}
    ok = state == "success" and published.get("round") == plan.rounds_requested
    if not ok:
        bad = {t: i["state"] for t, i in final["tasks"].items() if i["state"] not in OK_STATES}
        print(f"FAILED: run state {state}, tasks not successful: {bad or 'none'}; see {log_path}", file=sys.stderr)
        return 1
    print(f"final model: {published['final_model']} (sha256 {published['sha256']})")
    return 0


def _print_report(metrics_uri: str) -> None:
    print(format_table(read_metrics(metrics_uri)))


def _cmd_report(args: argparse.Namespace) -> int:
    _print_report(args.metrics)
    return 0


def _cmd_site_budget(args: argparse.Namespace) -> int:
    from flare_airflow.cli.site_budget import site_budget_text

    print(site_budget_text(policy=args.policy, site=args.site, delta=args.delta, releases=args.releases))
    return 0


def _cmd_try_trainer(args: argparse.Namespace) -> int:
    from flare_airflow.cli.try_trainer import try_trainer

    return try_trainer(
        args.job,
        args.site,
        model=args.model,
        round_num=args.round_num,
        hparams=args.hparam,
        workdir=args.workdir,
        environ=os.environ,
        site_policy=args.site_policy,
    )


def _cmd_pools_sync(args: argparse.Namespace) -> int:
    from flare_airflow.core.pools import required_pools
    from flare_airflow.hooks.pools import sync_pools

    try:
        job = load_job(args.job)
        required = required_pools(job)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not required:
        print(f"job {job.job!r} uses no GPU pools (no site asks for GPUs under a 'gpu' resource manager)")
        return 0
    drift, changes = sync_pools(job, check=args.check)
    for name, req in sorted(required.items()):
        print(f"pool {name}: {req.slots} slot(s) for {', '.join(req.sites)}; largest job asks {req.largest_request}")
    if args.check:
        for message in drift:
            print(f"drift: {message}")
        print("pools match the job" if not drift else f"{len(drift)} problem(s)")
        return 1 if drift else 0
    for change in changes:
        print(change)
    if not changes:
        print("pools already match the job; nothing changed")
    return 0


def _cmd_import_nvflare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flare_airflow.nvflare.importer import describe, import_job

    sites = [s.strip() for s in args.sites.split(",") if s.strip()] if args.sites else None
    result = import_job(
        Path(args.job_dir),
        Path(args.out),
        sites=sites,
        initial_model=Path(args.initial_model) if args.initial_model else None,
        name=args.name,
        force=args.force,
    )
    print(describe(result))
    return 0


def _cmd_site_data_ready(args: Any) -> int:
    import datetime as dt

    from flare_airflow.operators.data_ready import announce_via_api

    version = args.version or dt.datetime.now(dt.UTC).date().isoformat()
    extra = announce_via_api(args.site, version, args.samples, args.conn_id)
    print(
        f"site {args.site} announced data {extra['version']}"
        + (f" ({extra['samples']} samples)" if extra["samples"] is not None else "")
        + f" at {extra['announced_at']}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flare-airflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="validate a job YAML file")
    p.add_argument("job")
    p.set_defaults(func=_cmd_validate)
    p = sub.add_parser("run", help="run a DAG once through Airflow and check every task's final state")
    p.add_argument("dag_id")
    p.add_argument("--conf", help="run parameters as JSON, e.g. '{\"rounds\": 3}'")
    p.add_argument("--dagfile", help="parse only this DAG file instead of the whole dags folder")
    p.add_argument("--log", help="where to write Airflow's output (default: a temp file)")
    p.add_argument("--json", action="store_true", help="print the run's final state as JSON")
    p.set_defaults(func=_with_log(_run))
    p = sub.add_parser(
        "resume",
        help="continue a failed run from its first incomplete round (keeps completed rounds' global models)",
    )
    p.add_argument("dag_id")
    p.add_argument("run_id")
    p.add_argument("--from-round", type=int, help="start from this round (default: the first that did not complete)")
    p.add_argument("--dagfile", help="parse only this DAG file instead of the whole dags folder")
    p.add_argument("--log", help="where to write Airflow's output (default: a temp file)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--scheduler", action="store_true", help="let the scheduler run it (default if one is alive)")
    how.add_argument("--in-process", action="store_true", help="run the cleared tasks here, scheduler or not")
    p.add_argument("--no-wait", action="store_true", help="with a scheduler: clear and return without waiting")
    p.add_argument("--timeout", type=float, default=24 * 3600, help="with a scheduler: seconds to wait (default 1 day)")
    p.set_defaults(func=_with_log(_resume))
    p = sub.add_parser(
        "try-trainer",
        help="run the job's trainer by hand for one site and round, and check its update as a site task would",
    )
    p.add_argument("job", help="the job's YAML file")
    p.add_argument("--site", required=True, help="the site to run as (its env and cwd apply)")
    p.add_argument("--model", help="a plain safetensors file to start from (default: the job's initial_model)")
    p.add_argument("--round", type=int, default=1, dest="round_num", help="the round to run as (default 1)")
    p.add_argument("--hparam", action="append", default=[], metavar="KEY=VALUE", help="override a hyper-parameter")
    p.add_argument("--workdir", help="where the model store of this try goes (default: a new temp directory)")
    p.add_argument(
        "--site-policy",
        metavar="FILE",
        help="the site's policy file, applied as its worker applies it (default: $FLARE_SITE_CONFIG, if set)",
    )
    p.set_defaults(func=_cmd_try_trainer)
    p = sub.add_parser("report", help="print the per-round table of a run's metrics.json")
    p.add_argument("metrics", help="path or URI of metrics.json")
    p.set_defaults(func=_cmd_report)
    pools = sub.add_parser("pools", help="GPU pools of a job's sites").add_subparsers(dest="pools", required=True)
    p = pools.add_parser("sync", help="create/update the job's pools (idempotent); --check only reports drift")
    p.add_argument("job")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the pools do not match")
    p.set_defaults(func=_cmd_pools_sync)
    site = sub.add_parser("site", help="a site's own state on this worker: its keys, its privacy ledger")
    site_sub = site.add_subparsers(dest="site_command", required=True)
    p = site_sub.add_parser("budget", help="the site's privacy ledger: every release, ε spent, the budget")
    p.add_argument("--site", help="only this site")
    p.add_argument("--policy", help="the site policy file (default: $FLARE_SITE_CONFIG)")
    p.add_argument("--delta", type=float, default=1e-5, help="δ for sites without a budget (default 1e-5)")
    p.add_argument("--releases", action="store_true", help="list every release")
    p.set_defaults(func=_cmd_site_budget)
    p = site_sub.add_parser(
        "data-ready",
        help="announce that this site has fresh data (signed with the site's key on this worker): "
        "jobs with trigger.on_data count it",
    )
    p.add_argument("site", help="this site's name, as in the jobs (its signing key must be on this worker)")
    p.add_argument("--version", default=None, help="the data's version (default: today's date, UTC)")
    p.add_argument("--samples", type=int, default=None, help="the number of samples (optional)")
    p.add_argument("--conn-id", default=None, help="http connection of the REST API (default flare_airflow_api)")
    p.set_defaults(func=_cmd_site_data_ready)
    p = sub.add_parser(
        "import-nvflare", help="turn an NVIDIA FLARE job folder into a flare-airflow job (YAML, DAG, scripts)"
    )
    p.add_argument("job_dir", help="the NVFlare job folder (meta.json and its apps)")
    p.add_argument("--out", default=".", help="where to write <job>.yaml, <job>_dag.py and <job>/ (default: here)")
    p.add_argument("--sites", help="comma-separated site names, for a deploy_map that deploys to @ALL")
    p.add_argument("--initial-model", help="a safetensors file to start from (for persistors that build the model)")
    p.add_argument("--name", help="the job's name (default: meta.json's name)")
    p.add_argument("--force", action="store_true", help="replace an earlier import's files")
    p.set_defaults(func=_cmd_import_nvflare)
    add_trust_parsers(sub, site_sub)
    add_doctor_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except FlareAirflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def console() -> None:
    """The ``flare-airflow`` command: :func:`main`, then a quick exit once Airflow was loaded.

    Tearing down an interpreter that imported Airflow (its ORM, FastAPI apps, pydantic models)
    takes ~1.4 s of garbage collection and module clean-up that nothing needs: the run's state is
    committed and printed. Exit handlers still run (logging flushes its files), then ``os._exit``.
    """
    code = main()
    if "airflow" not in sys.modules:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)
