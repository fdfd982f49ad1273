"""Run one site job to completion and check its result: the command behind a site task.

:func:`main` (``python -m flare_airflow.site_task``) reads a :class:`SiteRun` (JSON) from the
environment variable ``FLARE_SITE_JOB_SPEC`` (and the resolved secret variables, JSON, from
``FLARE_SITE_SECRETS``: they go to the trainer's environment only); :func:`run_site` verifies the
input global model, launches the trainer through the process launcher, forwards SIGTERM/SIGINT
to it (so killing the Airflow task kills the trainer's process group), and then checks and
publishes what the trainer sent (:mod:`~flare_airflow.site_task.checks`).

Its last line of output is a JSON summary (the task's XCom); its exit code is the job's
``JobReturnCode``. Nothing of the job outlives the runner: it is a child subreaper (orphaned
descendants of the trainer are reparented to it) and ends every remaining descendant when the
trainer ends, however it ends; it gets SIGTERM when the task process that started it dies,
and stops the same way when any process named in ``FLARE_SITE_OWNERS`` (the task process and
its supervisor) ends (:mod:`~flare_airflow.site_task.owners`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import FrameType
from typing import Any

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.failure_record import write_failure
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import path_from_uri
from flare_airflow.launchers.gpus import GpuAllocationError, GpuAllocator, GpuLease
from flare_airflow.launchers.process import (
    LaunchError,
    ProcessJobHandle,
    ProcessLauncher,
    become_subreaper,
    die_with_parent,
)
from flare_airflow.launchers.process.sandbox import Sandbox
from flare_airflow.site_task.checks import (
    BaseModelRefused,
    GlobalModelUnusable,
    check_base_model,
    check_global_model,
    check_result,
    clear_outputs,
    model_fingerprint,
)
from flare_airflow.site_task.confinement import ConfinementRefused, confinement_hint, site_sandbox
from flare_airflow.site_task.owners import end_orphans, parse_owners, watch_owners
from flare_airflow.site_task.spec import (
    NOISE_SECRET_ENV,
    OWNERS_ENV,
    RESULT_FILE_ENV,
    SECRETS_ENV,
    SPEC_ENV,
    SUMMARY_PREFIX,
    SiteRun,
)
from flare_airflow.site_task.tries import Superseded, claim_try, later_try


class _Killed(BaseException):
    """Raised by the runner's signal handler to unwind out of ``wait()`` before terminating."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_site(
    run: SiteRun,
    launcher: ProcessLauncher | None = None,
    *,
    handle_signals: bool = True,
    on_launch: Callable[[ProcessJobHandle], None] | None = None,
    secrets: Mapping[str, str] | None = None,
    owners: Sequence[tuple[int, int]] = (),
    noise_secret: str | None = None,
) -> tuple[JobReturnCode, dict[str, Any] | str]:
    """Launch, wait, check. Returns the return code and the summary (or the failure reason).

    With ``handle_signals`` (the runner's own process) SIGTERM/SIGINT terminate the trainer and
    exit, the process becomes a child subreaper that ends every leftover descendant when the
    trainer ends, and the death of its parent (the task process) sends it SIGTERM. Callers inside
    a task process pass ``False`` and terminate via ``on_launch``'s handle. ``secrets`` are added
    to the trainer's environment only, and never repeated in a failure reason. With
    ``handle_signals``, the end of any of ``owners`` (pid, start time) stops the job like SIGTERM.
    ``noise_secret`` keys the noise of the site's privacy filters (never given to the trainer).
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
    sandbox: Sandbox | None = None
    checked: tuple[tuple[int, int, int], ...] | None = None
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
                threading.Thread(target=watch_owners, args=(owners, watch_done), daemon=True).start()
        try:
            check_global_model(run)
        except GlobalModelUnusable as exc:
            write_failure(output, JobReturnCode.INFRASTRUCTURE_ERROR, str(exc))
            return JobReturnCode.INFRASTRUCTURE_ERROR, str(exc)
        try:
            check_base_model(run)
        except BaseModelRefused as exc:
            write_failure(output, JobReturnCode.CONFIG_ERROR, str(exc))
            return JobReturnCode.CONFIG_ERROR, str(exc)
        checked = model_fingerprint(run)
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
            sandbox = site_sandbox(run, lambda line: print(line, flush=True))
        except ConfinementRefused as exc:
            write_failure(output, JobReturnCode.INFRASTRUCTURE_ERROR, str(exc))
            return JobReturnCode.INFRASTRUCTURE_ERROR, str(exc)
        try:
            handle = launcher.launch_job(job, sandbox=sandbox)
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
            importlib.import_module("flare_airflow.core.aggregation.update_reader")
            if run.trust is not None:  # signing needs cryptography (40-140 ms to import)
                importlib.import_module("flare_airflow.core.trust")
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
        # The task process that created the result file is gone (or ending): nobody else removes it.
        with contextlib.suppress(OSError):
            os.unlink(os.environ.get(RESULT_FILE_ENV) or "")
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
        if sandbox is not None:
            reason += confinement_hint(sandbox, handle.reason)
        write_failure(output, rc, reason)
        return rc, reason
    try:
        try:
            # A process trainer can write wherever its user can: its update was made from a model
            # that others will no longer find intact. Files that kept inode, size and mtime since
            # the check before the launch are intact; anything else is hashed again.
            if checked is None or model_fingerprint(run) != checked:
                check_global_model(run)
        except GlobalModelUnusable as exc:
            raise FlareAirflowError(f"the trainer changed or removed its input global model: {exc}") from None
        return JobReturnCode.SUCCESS, check_result(run, output, noise_secret)
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
    # Popped before the launch: the trainer inherits this environment and must not see it.
    noise_secret = os.environ.pop(NOISE_SECRET_ENV, "") or None
    print(f"site job {run.job}/{run.site} round {run.round}/{run.total_rounds} ({run.task}): {run.argv}", flush=True)
    rc, result = run_site(
        run, secrets=secrets, owners=parse_owners(os.environ.get(OWNERS_ENV, "")), noise_secret=noise_secret
    )
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
