"""Run one site job to completion and check its result: the command behind a site task.

``python -m flare_airflow.launchers.site_runner`` reads a :class:`SiteRun` (JSON) from the
environment variable ``FLARE_SITE_JOB_SPEC`` (and the resolved secret variables, JSON, from
``FLARE_SITE_SECRETS``: they go to the trainer's environment only), verifies the input global
model against its record, launches the trainer through the process launcher, forwards
SIGTERM/SIGINT to it (so killing the Airflow task kills the trainer's process group), and then
checks what the trainer sent: an update must exist, be safetensors with a valid
checksum, and match the global model's names, shapes and dtypes with finite values.

Its last line of output is a JSON summary (the task's XCom); its exit code is the job's
``JobReturnCode``. Nothing of the job outlives the runner: it is a child subreaper (orphaned
descendants of the trainer are reparented to it) and ends every remaining descendant when the
trainer ends, however it ends; it gets SIGTERM when the task process that started it dies,
and stops the same way when any process named in ``FLARE_SITE_OWNERS`` (the task process and
its supervisor) ends. An update is published only while no later try of the same site job has
started (:func:`claim_try`, :func:`publish_current_try`). A failed job leaves a failure record
next to the update, read by the aggregation task to say why the site did not count.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from types import FrameType
from typing import TYPE_CHECKING, Any

from flare_airflow.core import envvars
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.spec import JobReturnCode, SiteJob
from flare_airflow.core.store import path_from_uri, record_path
from flare_airflow.launchers.gpus import GpuAllocationError, GpuAllocator, GpuLease
from flare_airflow.launchers.process import (
    LaunchError,
    ProcessJobHandle,
    ProcessLauncher,
    become_subreaper,
    die_with_parent,
    end_processes,
    job_processes,
    start_time,
)

if TYPE_CHECKING:
    from flare_airflow.core.model import WritablePath

SPEC_ENV = envvars.FLARE_SITE_JOB_SPEC
# Resolved secret_env values for the trainer, kept out of the SiteRun (which may be logged).
SECRETS_ENV = envvars.FLARE_SITE_SECRETS
SUMMARY_PREFIX = "FLARE_RESULT "
# "pid:start_time pid:start_time": processes whose end ends the site job (the task process and its
# supervisor); PR_SET_PDEATHSIG reaches only the direct parent.
OWNERS_ENV = envvars.FLARE_SITE_OWNERS
_OWNER_POLL_SECONDS = 0.5
# A local file (outside the store) where the runner leaves its failure reason for the site task:
# it gets there even when the store is full or read-only and the failure record cannot be written.
RESULT_FILE_ENV = envvars.FLARE_SITE_RESULT_FILE


@dataclass
class SiteRun:
    """Everything a site job needs; serialised into the site task's environment."""

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

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SiteRun:
        return cls(**json.loads(text))

    def site_job(self) -> SiteJob:
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


def owners_value(pids: Sequence[int]) -> str:
    """The ``FLARE_SITE_OWNERS`` value naming ``pids`` (those still alive) with their start times."""
    return " ".join(f"{pid}:{start}" for pid in pids if pid > 1 and (start := start_time(pid)) is not None)


def parse_owners(text: str) -> list[tuple[int, int]]:
    owners = []
    for item in text.split():
        pid, _, start = item.partition(":")
        if pid.isdigit() and start.isdigit():
            owners.append((int(pid), int(start)))
    return owners


def _watch_owners(owners: Sequence[tuple[int, int]], stop: threading.Event) -> None:
    """Send this process SIGTERM (the runner's own stop path) once any owner has ended."""
    while not stop.wait(_OWNER_POLL_SECONDS):
        for pid, start in owners:
            if start_time(pid) != start:
                print(
                    f"process {pid}, which owns this site job, ended: stopping the site job",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return


class _Killed(BaseException):
    """Raised by the runner's signal handler to unwind out of ``wait()`` before terminating."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class GlobalModelUnusable(FlareAirflowError):
    """The input global model is missing or does not match its record: the trainer is not started."""


def check_global_model(run: SiteRun) -> None:
    """Verify the round's input global model against its record (size and sha256) before launching.

    Hashes the file with the standard library only (the update check's numpy loads later, while
    the trainer starts). Raises :class:`GlobalModelUnusable` saying what is wrong and what to do.
    """
    path = path_from_uri(run.global_model)
    record = record_path(path)
    where = f"site {run.site} round {run.round}: the input global model {run.global_model}"
    rerun = f"re-run the task that published it (round {run.round - 1}'s global model, or check initial_model)"
    if not path.exists():
        raise GlobalModelUnusable(f"{where} does not exist; {rerun}")
    if not record.exists():
        raise GlobalModelUnusable(f"{where} has no record {record.name} (never completed); {rerun}")
    try:
        with record.open("rb") as fh:
            raw = json.loads(fh.read(1_000_000))
        expected, size = str(raw["sha256"]), int(raw["size"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise GlobalModelUnusable(
            f"{where}: its record {record.name} is corrupted ({type(exc).__name__}); {rerun}"
        ) from None
    if run.global_sha256 and expected != run.global_sha256:
        raise GlobalModelUnusable(
            f"{where} is not the one its producer published (its record says sha256 {expected[:12]}…, the "
            f"producer's XCom {run.global_sha256[:12]}…): it was replaced; {rerun}"
        )
    digest = hashlib.sha256()
    got = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            got += len(chunk)
    if got != size or digest.hexdigest() != expected:
        raise GlobalModelUnusable(
            f"{where} does not match its record ({got} bytes, sha256 {digest.hexdigest()[:12]}…; the record says "
            f"{size} bytes, {expected[:12]}…): it was changed or corrupted after it was written; {rerun}"
        )


def end_orphans(grace: float) -> None:
    """End every descendant of this process (a subreaper's adopted orphans included) and reap them."""
    end_processes(lambda: job_processes(roots=(os.getpid(),)), grace)
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def failure_path(output: WritablePath) -> WritablePath:
    return output.parent / (output.name.removesuffix(".safetensors") + ".failure.json")


def clear_outputs(output: WritablePath) -> None:
    """Remove a previous try's result so that a re-run overwrites only this site's round."""
    for path in (output, record_path(output), failure_path(output)):
        path.unlink(missing_ok=True)


def write_failure(output: WritablePath, rc: JobReturnCode, reason: str) -> None:
    """Leave the reason for the aggregation; best effort: a full or read-only store must not hide
    the reason, which also goes to this task's log and error."""
    path = failure_path(output)
    tmp = path.parent / f".{path.name}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("w") as fh:  # then renamed: a full store leaves no empty record
            fh.write(json.dumps({"return_code": int(rc), "name": rc.name, "reason": reason}))
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        print(f"cannot write the failure record {path} ({exc.strerror or exc}): {reason}", file=sys.stderr, flush=True)


def read_failure(output: WritablePath) -> str | None:
    path = failure_path(output)
    if not path.exists():
        return None
    try:
        with path.open("r") as fh:
            data = json.loads(fh.read(1 << 16))
        return f"{str(data.get('reason', 'failed'))[:2000]} [{data.get('name', '?')}]"
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        return f"the site's failure record {path} is unreadable ({type(exc).__name__})"


def check_result(run: SiteRun, output: WritablePath) -> dict[str, Any]:
    """Verify what the trainer sent and publish it at ``output``; raise ``FlareAirflowError`` with
    the reason if it is unusable.

    The trainer wrote into its try's staging directory (``run.staging``); only an update that
    passed every check is moved to ``output``, so a failed, killed or late trainer never leaves a
    published update, and it cannot overwrite one either.
    """
    from flare_airflow.core.aggregation import validate_update
    from flare_airflow.core.model import read_artifact, read_record

    sent = path_from_uri(run.staging) if run.staging else output
    if not record_path(sent).exists():
        raise FlareAirflowError(
            f"the trainer exited successfully but sent no {'update' if run.task == 'train' else 'result'} "
            "(did it call flare.send()?)"
        )
    params, record = read_artifact(sent)
    if run.task == "train":
        # The global model's record has every tensor's dtype and shape: no need to read its weights.
        validate_update(run.site, read_record(path_from_uri(run.global_model)).tensors, params)
    del params
    if run.staging:
        publish_current_try(sent, output)
    return {
        "site": run.site,
        "round": run.round,
        "task": run.task,
        "uri": run.output,
        "sha256": record.sha256,
        "num_samples": record.num_samples,
        "params_type": record.params_type.value,
        "metrics": record.metrics,
    }


class Superseded(FlareAirflowError):
    """A later try of the same site job has started: this try's update is not published."""


def _try_number(path: Any) -> int | None:
    name = str(getattr(path, "name", ""))
    number = name.removeprefix("try-")
    return int(number) if name.startswith("try-") and number.isdigit() else None


@contextlib.contextmanager
def _tries_locked(site_dir: Any) -> Iterator[None]:
    """Serialise claims and publishes of one site job's tries (a local store: ``flock``; object
    stores have no lock, there the later try's claim and clear come first and a race stays)."""
    if not isinstance(site_dir, pathlib.Path):
        yield
        return
    site_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(site_dir / ".tries.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def claim_try(staging: str) -> None:
    """Mark this try as the site job's current one (its staging directory exists from now on):
    a try with a lower number will no longer publish (:func:`publish_current_try`)."""
    try_dir = path_from_uri(staging).parent
    with _tries_locked(try_dir.parent):
        try_dir.mkdir(parents=True, exist_ok=True)


def later_try(try_dir: Any) -> int | None:
    """The highest try number above ``try_dir``'s own among its site job's staging directories."""
    mine = _try_number(try_dir)
    if mine is None or not try_dir.parent.exists():
        return None
    return max((n for p in try_dir.parent.iterdir() if (n := _try_number(p)) is not None and n > mine), default=None)


def publish_current_try(staged: WritablePath, output: WritablePath) -> None:
    """:func:`publish` unless a later try of this site job has claimed its staging directory:
    a killed try's runner that lived on never replaces the update of the try that followed it."""
    with _tries_locked(staged.parent.parent):
        later = later_try(staged.parent)
        if later is not None:
            raise Superseded(
                f"{staged.parent.name} of this site job was superseded by try-{later}: its update is not published"
            )
        publish(staged, output)


def publish(staged: WritablePath, output: WritablePath) -> None:
    """Move a checked update from its staging directory to its published place, record last.

    A rename on a local store; a copy then a delete elsewhere (object stores cannot rename).
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    for src, dst in ((staged, output), (record_path(staged), record_path(output))):
        if hasattr(src, "replace") and getattr(src, "protocol", "file") in ("file", "local", ""):
            src.replace(dst)
        else:
            with src.open("rb") as fi, dst.open("wb") as fo:
                while piece := fi.read(1 << 22):
                    fo.write(piece)
            src.unlink()


def run_site(
    run: SiteRun,
    launcher: ProcessLauncher | None = None,
    *,
    handle_signals: bool = True,
    on_launch: Callable[[ProcessJobHandle], None] | None = None,
    secrets: Mapping[str, str] | None = None,
    owners: Sequence[tuple[int, int]] = (),
) -> tuple[JobReturnCode, dict[str, Any] | str]:
    """Launch, wait, check. Returns the return code and the summary (or the failure reason).

    With ``handle_signals`` (the runner's own process) SIGTERM/SIGINT terminate the trainer and
    exit, the process becomes a child subreaper that ends every leftover descendant when the
    trainer ends, and the death of its parent (the task process) sends it SIGTERM. Callers inside
    a task process pass ``False`` and terminate via ``on_launch``'s handle. ``secrets`` are added
    to the trainer's environment only, and never repeated in a failure reason. With
    ``handle_signals``, the end of any of ``owners`` (pid, start time) stops the job like SIGTERM.
    """
    output = path_from_uri(run.output)
    try:
        if run.staging:
            claim_try(run.staging)  # before the clear: an earlier try can no longer publish after it
        clear_outputs(output)
    except OSError as exc:
        reason = f"cannot prepare {output.parent} in the model store: {exc.strerror or exc}; check the store"
        return JobReturnCode.INFRASTRUCTURE_ERROR, reason
    launcher = launcher or ProcessLauncher(adopt_orphans=handle_signals, hidden=(secrets or {}).values())
    job = run.site_job()
    signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()

    # While numpy is imported a signal is only noted: raised inside numpy's C import, the
    # exception became an ImportError (a traceback, exit 1, and the kill was lost).
    deferred: dict[str, int | None] = {"active": 0, "signum": None}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        # Terminating here could deadlock: the signal may land while wait() is already inside
        # terminate() (launch timeout) holding its lock. Unwind instead and terminate below;
        # further signals are ignored meanwhile (that cleanup is bounded by shutdown_timeout).
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        if deferred["active"]:
            deferred["signum"] = signum
            return
        raise _Killed(signum)

    handle: ProcessJobHandle | None = None
    lease: GpuLease | None = None
    previous: dict[signal.Signals, Any] = {}
    watch_done = threading.Event()
    try:
        # Handlers first: a kill that lands while the trainer is being started still stops it.
        for s in signals:
            previous[s] = signal.signal(s, on_signal)
        if handle_signals:
            become_subreaper()  # before the launch: orphans must never reach init
            if not die_with_parent(signal.SIGTERM) and os.getppid() == 1:
                raise _Killed(signal.SIGTERM)  # the task process died before the runner got here
            if owners:
                threading.Thread(target=_watch_owners, args=(owners, watch_done), daemon=True).start()
        try:
            check_global_model(run)
        except GlobalModelUnusable as exc:
            write_failure(output, JobReturnCode.INFRASTRUCTURE_ERROR, str(exc))
            return JobReturnCode.INFRASTRUCTURE_ERROR, str(exc)
        if secrets:
            job = replace(job, env={**job.env, **secrets})
        if run.assign_gpus:
            try:
                lease = GpuAllocator(num_gpus=run.gpu_capacity).acquire(
                    run.num_gpus, run.mem_per_gpu_gib, timeout=run.gpu_wait_timeout
                )
            except GpuAllocationError as exc:
                write_failure(output, JobReturnCode.INFRASTRUCTURE_ERROR, str(exc))
                return JobReturnCode.INFRASTRUCTURE_ERROR, str(exc)
            job = replace(job, env={**job.env, "CUDA_VISIBLE_DEVICES": lease.cuda_visible_devices})
            print(f"GPUs assigned: CUDA_VISIBLE_DEVICES={lease.cuda_visible_devices!r}", flush=True)
        try:
            handle = launcher.launch_job(job)
        except LaunchError as exc:
            write_failure(output, JobReturnCode.EXECUTION_ERROR, str(exc))
            return JobReturnCode.EXECUTION_ERROR, str(exc)
        handle.hide((secrets or {}).values())
        if on_launch is not None:
            on_launch(handle)
        # The update check needs numpy: load it now, while the trainer starts on the other core,
        # not before the launch (the two start-ups would add up: ~50 ms per site job).
        deferred["active"] = 1
        try:
            importlib.import_module("flare_airflow.core.aggregation")
        finally:
            deferred["active"] = 0
        if deferred["signum"] is not None:
            raise _Killed(deferred["signum"])
        rc = handle.wait()
    except _Killed as killed:
        if handle is not None:
            handle.terminate()
        reason = f"site task was killed ({signal.Signals(killed.signum).name}); trainer process group terminated"
        if not (run.staging and later_try(path_from_uri(run.staging).parent)):  # the record is the later try's
            write_failure(output, JobReturnCode.ABORTED, reason)
        print(reason, file=sys.stderr, flush=True)
        sys.exit(128 + killed.signum)
    finally:
        watch_done.set()
        if handle_signals:
            end_orphans(run.shutdown_timeout)
        if lease is not None:
            lease.release()
        for s, h in previous.items():
            signal.signal(s, h)
    if rc is not JobReturnCode.SUCCESS:
        reason = f"trainer failed: {handle.reason}"
        write_failure(output, rc, reason)
        return rc, reason
    try:
        try:
            check_global_model(run)
        except GlobalModelUnusable as exc:
            # A process trainer can write wherever its user can: its update was made from a model
            # that others will no longer find intact.
            raise FlareAirflowError(f"the trainer changed or removed its input global model: {exc}") from None
        return JobReturnCode.SUCCESS, check_result(run, output)
    except Superseded as exc:  # the published update and failure record are the later try's
        return JobReturnCode.ABORTED, str(exc)
    except FlareAirflowError as exc:
        clear_outputs(output)
        write_failure(output, JobReturnCode.EXECUTION_ERROR, str(exc))
        return JobReturnCode.EXECUTION_ERROR, str(exc)


def main() -> int:
    text = os.environ.get(SPEC_ENV)
    if not text:
        print(f"{SPEC_ENV} is not set; this command is run by flare-airflow site tasks", file=sys.stderr)
        return int(JobReturnCode.CONFIG_ERROR)
    run = SiteRun.from_json(text)
    secrets = json.loads(os.environ.pop(SECRETS_ENV, "") or "{}")
    print(f"site job {run.job}/{run.site} round {run.round}/{run.total_rounds} ({run.task}): {run.argv}", flush=True)
    rc, result = run_site(run, secrets=secrets, owners=parse_owners(os.environ.get(OWNERS_ENV, "")))
    if rc is JobReturnCode.SUCCESS:
        print(SUMMARY_PREFIX + json.dumps(result, sort_keys=True), flush=True)
        return 0
    print(f"site {run.site} round {run.round} FAILED [{rc.name}]: {result}", file=sys.stderr, flush=True)
    result_file = os.environ.get(RESULT_FILE_ENV)
    if result_file:
        try:
            with open(result_file, "w") as fh:
                fh.write(json.dumps({"return_code": int(rc), "name": rc.name, "reason": str(result)}))
        except OSError as exc:
            print(f"cannot write {result_file}: {exc}", file=sys.stderr, flush=True)
    return int(rc) or 1


if __name__ == "__main__":
    code = main()
    # Nothing is left to clean up (the trainer's group is gone, the lease released, the files
    # closed): skip the interpreter's teardown of numpy & co., ~20 ms of every site job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
