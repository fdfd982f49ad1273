"""Running a DAG through Airflow's own ``airflow dags test`` in this process and reading the
outcome from the metadata database: what ``flare-airflow run`` and ``resume`` stand on.

In-process, not a subprocess: Airflow is imported once (a second interpreter importing Airflow
again for the state check cost ~3.6 s of every run). Output (fds 1 and 2, children included) goes
to a private log file created without following symlinks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

from flare_airflow.core.errors import FlareAirflowError

OK_STATES = {"success", "skipped"}


class CLIError(FlareAirflowError):
    """A command's input (a file, an option) is unusable; the message says which and why."""


def latest_run_key(dag_id: str) -> int:
    """The metadata database's key of the DAG's newest run (0 if it has none)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session() as session:
        return int(session.scalar(select(func.max(DagRun.id)).where(DagRun.dag_id == dag_id)) or 0)


def run_state(dag_id: str, run_id: str | None = None, *, newer_than: int = 0) -> dict[str, Any]:
    """The final state of a DAG run and of each of its task instances (latest run by default).

    ``newer_than``: only a run whose database key is larger counts (see :func:`latest_run_key`),
    so that a command that created no run never reports an earlier run's state.
    """
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        query = select(DagRun).where(DagRun.dag_id == dag_id, DagRun.id > newer_than)
        if run_id:
            query = query.where(DagRun.run_id == run_id)
        dag_run = session.scalars(query.order_by(DagRun.id.desc()).limit(1)).first()
        if dag_run is None:
            raise FlareAirflowError(
                f"no {'new ' if newer_than else ''}run of DAG {dag_id!r} found in the metadata database"
            )
        tis = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == dag_run.run_id)
        ).all()
        xcom = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dag_id,
                XComModel.run_id == dag_run.run_id,
                XComModel.task_id.like("%publish"),
                XComModel.key == "return_value",
            )
        ).first()
        failures = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dag_id, XComModel.run_id == dag_run.run_id, XComModel.key == "failure"
            )
        ).all()
        tasks: dict[str, dict[str, Any]] = {
            ti.task_id: {
                "state": str(ti.state),
                "try_number": ti.try_number,
                "start_date": ti.start_date.isoformat() if ti.start_date else None,
                "end_date": ti.end_date.isoformat() if ti.end_date else None,
                "duration": ti.duration,
            }
            for ti in tis
        }
        for failure in failures:
            if failure.task_id in tasks and tasks[failure.task_id]["state"] not in OK_STATES:
                tasks[failure.task_id]["reason"] = str(XComModel.deserialize_value(failure))
        return {
            "dag_id": dag_id,
            "run_id": dag_run.run_id,
            "state": str(dag_run.state),
            "tasks": tasks,
            "published": XComModel.deserialize_value(xcom) if xcom is not None else None,
        }


def open_log(path: str | None, dag_id: str) -> tuple[int, str]:
    """Create the run's log file and return its descriptor and path; never follows a symlink.

    ``path`` (``--log``) is opened with ``O_NOFOLLOW``. By default the log is a new file with an
    unpredictable name (``mkstemp``: exclusive create, mode 0600) under
    ``$AIRFLOW_HOME/logs/flare-airflow/``, or in the temp directory if that cannot be created.
    """
    if path:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(path, flags, 0o600), path
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CLIError(
                    f"--log {path}: is a symbolic link; refusing to write through it (give another path)"
                ) from None
            raise CLIError(f"--log {path}: cannot create the log file ({exc.strerror})") from None
    prefix = f"run-{re.sub(r'[^A-Za-z0-9_.-]+', '_', dag_id)[:100]}-{time.strftime('%Y%m%dT%H%M%S')}-"
    home = os.path.expanduser(os.environ.get("AIRFLOW_HOME", "~/airflow"))
    logs = os.path.join(home, "logs", "flare-airflow")
    try:
        os.makedirs(logs, mode=0o700, exist_ok=True)
        return tempfile.mkstemp(prefix=prefix, suffix=".log", dir=logs)
    except OSError:
        return tempfile.mkstemp(prefix=f"flare-airflow-{prefix}", suffix=".log")


@contextlib.contextmanager
def _output_to(log_fd: int) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so also the task
    subprocesses Airflow starts) to the open file ``log_fd``; restore them afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    # Python-level writers too, in case sys.stdout/sys.stderr are not descriptors 1 and 2 (an
    # embedding caller, pytest): a traceback printed here belongs in the log, never on the terminal.
    streams = sys.stdout, sys.stderr
    log = os.fdopen(os.dup(log_fd), "w", buffering=1)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.stdout = sys.stderr = log
        try:
            yield
        finally:
            log.flush()
    finally:
        sys.stdout, sys.stderr = streams
        log.close()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


_TASK_START = re.compile(r"\[DAG TEST\] starting task_id=(\S+) map_index=(-?\d+)")
_TASK_END = re.compile(r"\[DAG TEST\] end task task_id=(\S+) map_index=(-?\d+)")
MAX_RUN_LOG_BYTES = 256 * 1024 * 1024


def write_task_logs(run_log: str, state: dict[str, Any]) -> str | None:
    """Split an in-process run's output into one log file per task try, where Airflow keeps task logs.

    ``airflow dags test`` runs the tasks one after another in this process and writes no task log
    files: everything lands in the run's one log. Its ``[DAG TEST] starting/end task`` lines mark
    each task's part; each part goes to ``[logging] base_log_folder`` under Airflow's
    ``log_filename_template`` (``dag_id=…/run_id=…/task_id=…/attempt=N.log``), so the UI's Logs tab
    shows it. Existing files are never overwritten and symbolic links never followed. Returns the
    run's log folder, or ``None`` when nothing was written.
    """
    import jinja2
    from airflow.configuration import conf

    try:
        with open(run_log, "rb") as fh:
            text = fh.read(MAX_RUN_LOG_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    parts: dict[tuple[str, int], list[list[str]]] = {}
    current: list[str] | None = None
    for line in text.splitlines(keepends=True):
        if start := _TASK_START.search(line):
            current = []
            parts.setdefault((start.group(1), int(start.group(2))), []).append(current)
        if current is not None:
            current.append(line)
        if _TASK_END.search(line):
            current = None
    base = os.path.expanduser(conf.get("logging", "base_log_folder"))
    template = jinja2.Template(conf.get("logging", "log_filename_template"))
    folder = None
    for (task_id, map_index), tries in parts.items():
        info = state["tasks"].get(task_id)
        if info is None:
            continue
        last = int(info.get("try_number") or len(tries))
        for offset, lines in enumerate(tries):
            try_number = max(1, last - len(tries) + 1 + offset)
            ti = {"dag_id": state["dag_id"], "run_id": state["run_id"], "task_id": task_id, "map_index": map_index}
            path = os.path.join(base, template.render(ti=ti, try_number=try_number))
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(path, flags, 0o644)
                with os.fdopen(fd, "w") as out:
                    out.writelines(lines)
                folder = folder or os.path.dirname(os.path.dirname(path))
    return folder


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception)): ", re.MULTILINE)


def exception_text(stacktrace: str) -> str:
    """The exception and its (possibly multi-line) message at the end of a formatted traceback."""
    found = list(_EXCEPTION_LINE.finditer(stacktrace))
    if not found:
        return "\n".join(stacktrace.strip().splitlines()[-5:])
    last = found[-1]
    return f"{last.group(1)}: {stacktrace[last.end() :].strip()}"


def dag_import_errors(dagfile: str | None) -> dict[str, str]:
    """Parse the DAG file (or the dags folder) again and return each file's import error."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=os.path.abspath(dagfile) if dagfile else None)  # None: the dags folder
    return {path: exception_text(text) for path, text in sorted(bag.import_errors.items())}


def _dags_folder_containing(path: str) -> None:
    """Airflow parses only files inside its DAGs folder ("... is not in the subpath of ..."): for a
    DAG file elsewhere, this process's DAGs folder becomes the file's directory."""
    from airflow import settings
    from airflow.configuration import conf

    folder = os.path.realpath(settings.DAGS_FOLDER)
    if os.path.commonpath([folder, os.path.realpath(path)]) == folder:
        return
    directory = os.path.dirname(os.path.realpath(path))
    conf.set("core", "dags_folder", directory)
    settings.DAGS_FOLDER = directory


DAG_RUN_FAILED = "DagRun failed"  # what `airflow dags test` exits with when the run it made failed


def dags_test(dag_id: str, *, dagfile: str | None = None, conf: str | None = None) -> tuple[int, str]:
    """Run Airflow's ``airflow dags test DAG_ID`` command in this process.

    Returns its exit status and, when it stopped with an error, that error's message.
    """
    from airflow.cli import cli_parser
    from airflow.configuration import write_default_airflow_configuration_if_needed

    write_default_airflow_configuration_if_needed()
    argv = ["dags", "test", dag_id]
    if dagfile:  # absolute: Airflow fails on a relative path ("not in the subpath of" the dags folder)
        path = os.path.abspath(dagfile)
        argv += ["--dagfile-path", path]
        _dags_folder_containing(path)
    if conf:
        argv += ["--conf", conf]
    args = cli_parser.get_parser().parse_args(argv)
    try:
        args.func(args)
    except SystemExit as exc:  # DAG_RUN_FAILED, a bad --conf
        if exc.code not in (None, 0):
            print(f"airflow dags test: {exc.code}", file=sys.stderr)
            return (exc.code if isinstance(exc.code, int) else 1), str(exc.code)
    except Exception as exc:  # a DAG that is missing or does not parse: the traceback goes to the log
        traceback.print_exc()
        return 1, f"{type(exc).__name__}: {exc}"
    finally:
        _stop_listeners()
    return 0, ""


def _stop_listeners() -> None:
    """Tell Airflow's listeners this run's process is stopping, as Airflow's own jobs do when they
    end: ``dags test`` never does, and OpenLineage's DAG-run events go through a process pool that
    otherwise keeps this process waiting at exit, forever."""
    from airflow.listeners.listener import get_listener_manager

    manager = get_listener_manager()
    if manager.has_listeners:
        manager.hook.before_stopping(component=_DagsTest())


class _DagsTest:
    """The component that stops (listeners log its class name)."""
