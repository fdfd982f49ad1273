"""SLURM job trigger: watches one site job's batch job until it ends, streaming its output.

Every read goes through the launcher's handle (:class:`flare_airflow.launchers.slurm.SlurmJobHandle`,
rebuilt from the job's id, name and output file) and so through the one state table
(:func:`flare_airflow.launchers.slurm.map_job`). New lines of the job's output file go to the
task's log as they appear (the triggerer writes a deferred task's trigger log into the task log).
It never raises: failures become ``error`` events.

Events (``TriggerEvent.payload``)::

    {"status": "success" | "failed" | "timeout" | "error", "job_id", "name", "state", "native",
     "return_code", "reason", "offset"}

``failed``: the job ended without success (or could not start before its timeouts: it was
cancelled); ``timeout``: the task's execution_timeout passed -- the job was cancelled; ``error``:
the job could not be watched (it may still run; the operator cancels it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from flare_airflow.core.config import AirflowSecretRef, SlurmLaunchSpec
from flare_airflow.core.spec import EventStatus, JobReturnCode, JobState, SiteJobEvent
from flare_airflow.hooks.secrets import secret_value
from flare_airflow.hooks.slurm import slurm_commands
from flare_airflow.launchers.slurm import SlurmCommandError, SlurmJobHandle, SubmittedJob, cancel


class SlurmJobTrigger(BaseTrigger):
    """Wait for a site's SLURM job to end.

    :param job_id: the SLURM job id.
    :param name: the job's name (identity: job, run, round, site, try).
    :param output: the job's output file on the submit host.
    :param submitted_at: epoch seconds when it was submitted (pending timeouts count from there).
    :param connection: ``local`` or ``ssh:<conn id>`` (the site's ``launcher_spec.slurm.connection``).
    :param pending_timeout: seconds PENDING for Resources / Priority.
    :param startup_timeout: seconds PENDING for any other reason.
    :param poll_interval: seconds between reads.
    :param execution_deadline: epoch seconds after which the job is cancelled (the task's execution_timeout).
    :param offset: bytes of the output already shown (a re-deferred watch continues there).
    :param prefix: prefix of each output line in the task log.
    :param secret_refs: the site's ``secret_env`` references (never values): resolved again where the
        trigger runs, so that a trainer printing a secret shows ``***`` in the task log.
    :param cancel_on_kill: cancel the job when the deferred task is killed or marked failed (the
        fused site task owns its job; a sensor watching a job it did not launch does not).
    """

    _FIELDS = (
        "job_id",
        "name",
        "output",
        "submitted_at",
        "connection",
        "pending_timeout",
        "startup_timeout",
        "poll_interval",
        "execution_deadline",
        "offset",
        "prefix",
        "secret_refs",
        "cancel_on_kill",
    )

    def __init__(
        self,
        job_id: str,
        name: str,
        output: str,
        submitted_at: float,
        connection: str = "local",
        pending_timeout: float = 300.0,
        startup_timeout: float = 120.0,
        poll_interval: float = 2.0,
        execution_deadline: float | None = None,
        offset: int = 0,
        prefix: str = "",
        secret_refs: dict[str, dict[str, Any]] | None = None,
        cancel_on_kill: bool = True,
    ) -> None:
        super().__init__()
        self.job_id = job_id
        self.name = name
        self.output = output
        self.submitted_at = submitted_at
        self.connection = connection
        self.pending_timeout = pending_timeout
        self.startup_timeout = startup_timeout
        self.poll_interval = poll_interval
        self.execution_deadline = execution_deadline
        self.offset = offset
        self.prefix = prefix
        self.secret_refs = secret_refs
        self.cancel_on_kill = cancel_on_kill
        self._fired = False
        self._handle: SlurmJobHandle | None = None
        self._sink: Any = None

    @classmethod
    def for_job(
        cls,
        spec: SlurmLaunchSpec,
        submitted: SubmittedJob,
        *,
        offset: int = 0,
        prefix: str = "",
        execution_deadline: float | None = None,
        cancel_on_kill: bool = True,
    ) -> SlurmJobTrigger:
        """The trigger that watches ``submitted`` with the site's timeouts, polling and secret references."""
        return cls(
            job_id=submitted.job_id,
            name=submitted.name,
            output=submitted.output,
            submitted_at=submitted.submitted_at,
            connection=spec.connection,
            pending_timeout=spec.pending_timeout,
            startup_timeout=spec.startup_timeout,
            poll_interval=spec.poll_interval,
            execution_deadline=execution_deadline,
            offset=offset,
            prefix=prefix,
            secret_refs={name: ref.model_dump(exclude_defaults=True) for name, ref in spec.secret_env.items()} or None,
            cancel_on_kill=cancel_on_kill,
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {f: getattr(self, f) for f in self._FIELDS}

    def handle(self) -> SlurmJobHandle:
        if self._handle is None:
            spec = SlurmLaunchSpec(
                connection=self.connection,
                pending_timeout=self.pending_timeout,
                startup_timeout=self.startup_timeout,
                poll_interval=self.poll_interval,
            )
            self._handle = SlurmJobHandle.attach(
                slurm_commands(self.connection),
                SubmittedJob(self.job_id, self.name, self.output, self.submitted_at),
                spec,
                sink=self._line,
                offset=self.offset,
            )
        return self._handle

    def stream_to(self, sink: Any) -> None:
        """Send output lines to ``sink(line)`` instead of this trigger's log (a worker waiting in
        sync mode passes its task logger; in the triggerer the trigger's log is the task's log)."""
        self._sink = sink

    def _line(self, line: str) -> None:
        if self._sink is not None:
            self._sink(self.prefix + line)
        else:
            self.log.info("%s%s", self.prefix, line)

    def _event(self, status: EventStatus, rc: JobReturnCode, reason: str, state: JobState) -> TriggerEvent:
        self._fired = True
        handle = self._handle
        event: SiteJobEvent = {
            "status": status,
            "job_id": self.job_id,
            "name": self.name,
            "state": state.value,
            "native": handle.status.native if handle else "",
            "return_code": int(rc),
            "reason": reason,
            "offset": handle.output.offset if handle else self.offset,
            "last_output": handle.output.last_lines() if handle else "",
        }
        return TriggerEvent(event)

    def _hide_secrets(self, handle: SlurmJobHandle) -> None:
        if not self.secret_refs:
            return
        from airflow.sdk.log import mask_secret

        for name, ref in self.secret_refs.items():
            try:
                value = secret_value(AirflowSecretRef(**ref))
            except Exception as exc:  # a lookup failure must not stop the watch; say it
                self.log.warning("cannot resolve secret_env %s to hide it in the job's output: %s", name, exc)
                continue
            mask_secret(value, name)
            handle.output.hidden.add(value)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            handle = self.handle()
            await asyncio.to_thread(self._hide_secrets, handle)
            while True:
                rc = await asyncio.to_thread(handle.poll)
                status = handle.status
                if status.done:
                    ok = status.state is JobState.SUCCEEDED
                    yield self._event("success" if ok else "failed", rc, handle.reason, status.state)
                    return
                if self.execution_deadline is not None and time.time() > self.execution_deadline:
                    await asyncio.to_thread(handle.terminate)
                    reason = f"the task's execution_timeout passed: SLURM job {self.job_id} was cancelled"
                    yield self._event("timeout", JobReturnCode.ABORTED, reason, JobState.TERMINATED)
                    return
                await asyncio.sleep(self.poll_interval)
        except Exception as exc:  # never raise: the operator decides (and cancels the job)
            reason = f"cannot watch SLURM job {self.job_id}: {type(exc).__name__}: {str(exc)[:500]}"
            yield self._event("error", JobReturnCode.INFRASTRUCTURE_ERROR, reason, JobState.UNKNOWN)

    async def on_kill(self) -> None:
        """The task was killed or marked failed while deferred: cancel its job (Airflow >= 3.3)."""
        if self._fired or not self.cancel_on_kill:
            return
        self.log.info("task killed: cancelling SLURM job %s (%s)", self.job_id, self.name)
        try:
            await asyncio.to_thread(cancel, slurm_commands(self.connection), [self.job_id])
        except SlurmCommandError as exc:
            self.log.warning("could not cancel SLURM job %s: %s", self.job_id, exc)
