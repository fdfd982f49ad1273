"""Process launcher: a site job is a local process started from an exact argv (never a shell).

The trainer runs in its own process group so that ``terminate()`` reaches everything it started:
SIGTERM to the group, SIGKILL after ``shutdown_timeout``. Output streams line by line to a sink
(the Airflow task log when run from a site task). Exit codes and signals map to ``JobReturnCode``
in :func:`map_exit`, the one table for this backend (``docs/state-mapping.md``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from flare_airflow.core.spec import JobHandleSpec, JobLauncherSpec, JobReturnCode, JobState, LineSink, SiteJob

_POLL_INTERVAL = 0.05
# Variables of the Airflow worker that a trainer must never see (database URLs, connections, keys).
_HIDDEN_PREFIXES = ("AIRFLOW", "_AIRFLOW", "FLARE_SITE_JOB_SPEC")
_PASSTHROUGH_CODES = {
    JobReturnCode.EXCEPTION,
    JobReturnCode.UNSAFE_COMPONENT,
    JobReturnCode.CONFIG_ERROR,
    JobReturnCode.INFRASTRUCTURE_ERROR,
}


class LaunchError(RuntimeError):
    """The process could not be started (missing executable, bad cwd, ...)."""


def map_exit(code: int | None, *, terminated: bool) -> tuple[JobState, JobReturnCode, str]:
    """Map a process exit status to ``(state, return code, reason)``.

    =================================  ===========  ====================
    exit status                        state        return code
    =================================  ===========  ====================
    still running                      running      UNKNOWN
    0                                  succeeded    SUCCESS
    101 / 102 / 103 / 104              failed       same code
    any other code > 0                 failed       EXECUTION_ERROR
    any status after our terminate()   terminated   ABORTED
    signal, not ours (OOM kill, crash) failed       EXECUTION_ERROR
    =================================  ===========  ====================
    """
    if code is None:
        return JobState.RUNNING, JobReturnCode.UNKNOWN, ""
    if terminated:
        # We asked it to stop: whatever it exited with, it did not finish its work.
        how = _signal_name(-code) if code < 0 else f"exit code {code}"
        return JobState.TERMINATED, JobReturnCode.ABORTED, f"terminated ({how})"
    if code == 0:
        return JobState.SUCCEEDED, JobReturnCode.SUCCESS, ""
    if code < 0:
        name = _signal_name(-code)
        hint = " (possibly the out-of-memory killer)" if -code == signal.SIGKILL else ""
        return JobState.FAILED, JobReturnCode.EXECUTION_ERROR, f"killed by {name}{hint}"
    if code in _PASSTHROUGH_CODES:
        rc = JobReturnCode(code)
        return JobState.FAILED, rc, f"exit code {code} ({rc.name})"
    return JobState.FAILED, JobReturnCode.EXECUTION_ERROR, f"exit code {code}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def trainer_environment(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The trainer's environment: the worker's minus Airflow's own variables, plus ``extra``."""
    env = {k: v for k, v in base.items() if not k.startswith(_HIDDEN_PREFIXES)}
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class ProcessJobHandle(JobHandleSpec):
    """Handle of a trainer running as a local process group."""

    def __init__(self, job: SiteJob, proc: subprocess.Popen[str], sink: LineSink, handshake: Path | None) -> None:
        self.job = job
        self.proc = proc
        self._sink = sink
        self._handshake = handshake
        self._started = time.monotonic()
        self._terminated = False
        self._reason = ""
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._reader.start()

    def _pump(self, stream: IO[str] | None) -> None:
        if stream is None:
            return
        for line in stream:
            self._sink(line.rstrip("\n"))
        stream.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _check_launch_timeout(self) -> None:
        timeout = self.job.launch_timeout
        if timeout is None or self._handshake is None or self._terminated:
            return
        if time.monotonic() - self._started > timeout and not self._handshake.exists():
            self._reason = f"the trainer did not call receive() within launch_timeout={timeout:g}s"
            self.terminate()

    def poll(self) -> JobReturnCode:
        code = self.proc.poll()
        if code is None:
            self._check_launch_timeout()
            code = self.proc.poll()
        return map_exit(code, terminated=self._terminated)[1]

    @property
    def state(self) -> JobState:
        return map_exit(self.proc.poll(), terminated=self._terminated)[0]

    @property
    def reason(self) -> str:
        return self._reason or map_exit(self.proc.poll(), terminated=self._terminated)[2]

    def _launch_pending(self) -> bool:
        """Whether the launch timeout still has to be watched (no receive() seen yet)."""
        return (
            self.job.launch_timeout is not None
            and self._handshake is not None
            and not self._terminated
            and not self._handshake.exists()
        )

    def wait(self, timeout: float | None = None) -> JobReturnCode:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not JobReturnCode.UNKNOWN or self.proc.returncode is not None:
                self._finish()
                return rc
            if deadline is not None and time.monotonic() >= deadline:
                return JobReturnCode.UNKNOWN
            # Block in waitpid (returns the moment the trainer exits) unless the launch timeout
            # or the caller's deadline needs a look sooner; a sleep-poll loop cost ~25 ms per job.
            step = _POLL_INTERVAL if self._launch_pending() else None
            if deadline is not None:
                remaining = max(0.0, deadline - time.monotonic())
                step = remaining if step is None else min(step, remaining)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=step)

    def _finish(self) -> None:
        # The leader has exited; anything it left in its group goes too.
        self._kill_group(signal.SIGKILL)
        self._reader.join(timeout=5)
        if self._handshake is not None:
            self._handshake.unlink(missing_ok=True)

    def _kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def terminate(self) -> None:
        with self._lock:
            if self.proc.poll() is not None:
                self._finish()
                return
            self._terminated = True
            self._kill_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.job.shutdown_timeout)
            except subprocess.TimeoutExpired:
                self._kill_group(signal.SIGKILL)
                self.proc.wait()
            self._finish()


def _load_libc() -> Any:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """SIGKILL the trainer if the launching process dies without terminating it (Linux)."""
    # Only a foreign call here: the child of a threaded parent must not import or allocate.
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _default_sink(line: str) -> None:
    print(line, flush=True)


class ProcessLauncher(JobLauncherSpec):
    """Launch site jobs as local processes (NVFlare's process launcher)."""

    def __init__(self, sink: LineSink | None = None, prefix_lines: bool = True) -> None:
        self.sink = sink or _default_sink
        self.prefix_lines = prefix_lines

    def launch_job(self, job_meta: SiteJob, fl_ctx: Mapping[str, Any] | None = None) -> ProcessJobHandle:
        if not job_meta.argv:
            raise LaunchError(f"{job_meta.label}: empty argv")
        handshake: Path | None = None
        extra = dict(job_meta.env)
        if job_meta.launch_timeout is not None:
            fd, name = tempfile.mkstemp(prefix="flare-handshake-")
            os.close(fd)
            handshake = Path(name)
            handshake.unlink()
            extra["FLARE_HANDSHAKE"] = str(handshake)
        env = trainer_environment(os.environ, extra)
        prefix = f"[{job_meta.site} r{job_meta.round}] " if self.prefix_lines else ""
        sink = self.sink

        def emit(line: str) -> None:
            sink(prefix + line)

        try:
            proc = subprocess.Popen(
                list(job_meta.argv),
                env=env,
                cwd=job_meta.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                bufsize=1,
                start_new_session=True,
                close_fds=True,
                preexec_fn=_die_with_parent if _LIBC is not None else None,
            )
        except OSError as exc:
            raise LaunchError(f"{job_meta.label}: cannot start {job_meta.argv[0]!r}: {exc.strerror or exc}") from exc
        return ProcessJobHandle(job_meta, proc, emit, handshake)
