"""FLARE job trigger (NVFlare-native mode): follows one job of a FLARE deployment until it ends.

The triggerer never imports ``nvflare``: the trigger runs the admin bridge's ``watch`` command
(:mod:`flare_airflow.nvflare_native.bridge`) as a child process with NVFlare's interpreter -- one
login for the whole watch -- and reads a line per status change. A bridge that ends without a final
status (the server restarted, the network dropped) is started again, up to ``max_reconnects`` times
in a row. It never raises: failures become ``error`` events.

Events (``TriggerEvent.payload``)::

    {"status": "success" | "failed" | "error", "job_id", "native", "state", "return_code",
     "reason", "logs"}

``success``: ``FINISHED:COMPLETED``; ``failed``: any other end state (``native`` says which,
``logs`` holds the tail of each site's job log); ``error``: the job could not be followed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from flare_airflow.core.spec import JobReturnCode, JobState
from flare_airflow.hooks.flare_admin import FlareAdminHook
from flare_airflow.launchers.process.tree import child_preexec
from flare_airflow.nvflare_native.admin import PREFIX, FlareAdmin, parse_answers
from flare_airflow.nvflare_native.errors import FlareAdminError
from flare_airflow.nvflare_native.states import map_status


def format_logs(logs: dict[str, str]) -> str:
    return "\n".join(f"--- {site} ---\n{text.rstrip()}" for site, text in logs.items() if text.strip())


class FlareJobTrigger(BaseTrigger):
    """Wait for a FLARE job to end.

    :param job_id: the FLARE job id.
    :param flare_conn_id: the Airflow connection of the FLARE admin API (:class:`FlareAdminHook`).
    :param poll_interval: seconds between status reads.
    :param log_lines: lines of each site's job log carried by a ``failed`` event.
    :param max_reconnects: bridge restarts in a row before the trigger gives up with ``error``.
    :param abort_on_kill: abort the FLARE job when the deferred task is killed or marked failed.
    """

    _FIELDS = ("job_id", "flare_conn_id", "poll_interval", "log_lines", "max_reconnects", "abort_on_kill")

    def __init__(
        self,
        job_id: str,
        flare_conn_id: str,
        poll_interval: float = 2.0,
        log_lines: int = 30,
        max_reconnects: int = 5,
        abort_on_kill: bool = True,
    ) -> None:
        super().__init__()
        self.job_id = job_id
        self.flare_conn_id = flare_conn_id
        self.poll_interval = poll_interval
        self.log_lines = log_lines
        self.max_reconnects = max_reconnects
        self.abort_on_kill = abort_on_kill
        self._fired = False

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {f: getattr(self, f) for f in self._FIELDS}

    def _event(self, status: str, native: str, reason: str, logs: dict[str, str] | None = None) -> TriggerEvent:
        self._fired = True
        mapped = map_status(native) if native else None
        return TriggerEvent(
            {
                "status": status,
                "job_id": self.job_id,
                "native": native,
                "state": mapped.state.value if mapped else JobState.UNKNOWN.value,
                "return_code": int(mapped.return_code if mapped else JobReturnCode.INFRASTRUCTURE_ERROR),
                "reason": reason,
                "logs": logs or {},
            }
        )

    async def _watch_once(self, admin: FlareAdmin) -> dict[str, Any]:
        """One bridge ``watch`` run: its final answer, or the error / last status it ended with."""
        proc = await asyncio.create_subprocess_exec(
            *admin.watch_argv(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,  # one pipe, always drained: NVFlare's output cannot block it
            preexec_fn=child_preexec(),  # a triggerer killed with -9 takes its watcher along
        )
        last: dict[str, Any] = {}
        other: list[str] = []
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(
                admin.request(job_id=self.job_id, poll=self.poll_interval, log_lines=self.log_lines).encode()
            )
            await proc.stdin.drain()
            proc.stdin.close()
            async for raw in proc.stdout:
                line = raw.decode(errors="replace")
                if not line.startswith(PREFIX):
                    other = [*other[-19:], line.rstrip()]
                for answer in parse_answers(line):
                    last = answer
                    if "status" in answer and not answer.get("final"):
                        self.log.info("FLARE job %s: %s", self.job_id, answer["status"])
            await proc.wait()
            if not last:
                output = "\n".join(other)[-800:]
                last = {"error": {"kind": "internal", "message": f"the bridge exited {proc.returncode}: {output}"}}
            return last
        finally:
            if proc.returncode is None:  # cancelled (task killed, triggerer stopping): end the watcher too
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            admin = await asyncio.to_thread(FlareAdminHook(self.flare_conn_id).admin)
            failures: list[str] = []
            while True:
                answer = await self._watch_once(admin)
                if answer.get("final"):
                    native = str(answer["status"])
                    mapped = map_status(native)
                    logs = {str(k): str(v) for k, v in dict(answer.get("logs", {})).items()}
                    if mapped.succeeded:
                        yield self._event("success", native, f"FLARE job {self.job_id} {native}", logs)
                    else:
                        reason = (
                            f"FLARE job {self.job_id} ended {native} ({mapped.meaning}); the last lines of its logs:\n"
                            f"{format_logs(logs) or '(no logs)'}"
                        )
                        yield self._event("failed", native, reason, logs)
                    return
                error = answer.get("error") or {}
                failures.append(str(error.get("message", answer)))
                if error.get("kind") == "credential" or len(failures) > self.max_reconnects:
                    reason = f"cannot follow FLARE job {self.job_id}: {failures[-1]}"
                    yield self._event("error", str(answer.get("status", "")), reason)
                    return
                self.log.warning("following FLARE job %s again after: %s", self.job_id, failures[-1])
                await asyncio.sleep(min(30.0, self.poll_interval * 2 ** len(failures)))
        except FlareAdminError as exc:
            yield self._event("error", "", f"cannot follow FLARE job {self.job_id}: {exc}")
        except Exception as exc:  # never raise: the operator decides
            yield self._event("error", "", f"cannot follow FLARE job {self.job_id}: {type(exc).__name__}: {exc}")

    async def on_kill(self) -> None:
        """The task was killed or marked failed while deferred: abort its FLARE job (Airflow >= 3.3)."""
        if self._fired or not self.abort_on_kill:
            return
        self.log.info("task killed: aborting FLARE job %s", self.job_id)
        try:
            admin = await asyncio.to_thread(FlareAdminHook(self.flare_conn_id).admin)
            status = await asyncio.to_thread(admin.abort, self.job_id)
            self.log.info("FLARE job %s is %s", self.job_id, status)
        except FlareAdminError as exc:
            self.log.warning("could not abort FLARE job %s: %s", self.job_id, exc)
