"""Process launcher: a site job is a local process started from an exact argv (never a shell).

The trainer runs in its own session and process group, and carries a random job mark in its
environment (``FLARE_PROCESS_TREE``) that its descendants inherit. When the trainer ends, or
``terminate()`` is called, every process of the job that this process can see is ended: the
trainer's descendants, its session and group, processes that left them (``setsid``, double fork)
but still carry the mark, and -- in a child subreaper such as the site runner -- orphans that
were reparented here. SIGTERM to each one's group first, SIGKILL after ``shutdown_timeout``.
Output streams line by line to a sink (the Airflow task log when run from a site task). Exit
codes and signals map to ``JobReturnCode`` in :func:`map_exit`, the one table for this backend
(``docs/state-mapping.md``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.spec import JobHandleSpec, JobLauncherSpec, JobReturnCode, JobState, LineSink, SiteJob

_POLL_INTERVAL = 0.05
# Variables of the Airflow worker that a trainer must never see (database URLs, connections, keys).
_HIDDEN_PREFIXES = ("AIRFLOW", "_AIRFLOW", "FLARE_SITE_JOB_SPEC", "FLARE_SITE_SECRETS")
# Inherited by everything the trainer starts: finds its processes after they left its session.
TREE_MARK_ENV = "FLARE_PROCESS_TREE"
_TAIL_LINES = 20
_TAIL_CHARS = 300
_PASSTHROUGH_CODES = {
    JobReturnCode.EXCEPTION,
    JobReturnCode.UNSAFE_COMPONENT,
    JobReturnCode.CONFIG_ERROR,
    JobReturnCode.INFRASTRUCTURE_ERROR,
}


class LaunchError(FlareAirflowError, RuntimeError):
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


# ---------------------------------------------------------------- the processes of a job


def _stat(pid: int) -> tuple[int, int, int, str] | None:
    """``(ppid, pgrp, session, state)`` of a process, or ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0].decode()


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[3] not in ("Z", "X")


def _holds_mark(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return needle in fh.read().split(b"\0")
    except OSError:  # gone, or another user's process (then not ours to end either)
        return False


def job_processes(
    *, roots: Iterable[int] = (), sessions: Collection[int] = (), mark: str | None = None, exclude: Collection[int] = ()
) -> set[int]:
    """Live processes of a job as ``/proc`` shows them (Linux; elsewhere an empty set).

    :param roots: their descendants are included (not the roots themselves).
    :param sessions: members of these sessions (and process groups of the same ids) are included.
    :param mark: processes whose environment holds ``FLARE_PROCESS_TREE=<mark>`` are included.
    :param exclude: never included (nor is this process, its group or its ancestors' session).
    """
    try:
        names = os.listdir("/proc")
    except OSError:
        return set()
    table: dict[int, tuple[int, int, int, str]] = {}
    for name in names:
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            table[int(name)] = stat
    own = os.getpid()
    needle = f"{TREE_MARK_ENV}={mark}".encode() if mark else None
    found = {
        pid
        for pid, (_, pgrp, sid, _) in table.items()
        if sid in sessions or pgrp in sessions or (needle is not None and _holds_mark(pid, needle))
    }
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, *_rest) in table.items():
        children[ppid].append(pid)
    stack = [*roots, *found]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return {p for p in found if p != own and p not in exclude and table[p][3] not in ("Z", "X")}


def _signal_processes(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each process and to its process group (never to this process's own group)."""
    own_group = os.getpgrp()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group != own_group:
                os.killpg(group, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap(pids: Iterable[int]) -> None:
    """Collect the exit status of those of ``pids`` that are this process's exited children."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def end_processes(find: Callable[[], set[int]], grace: float) -> set[int]:
    """End every process ``find()`` returns: SIGTERM (to each one's group), SIGKILL after ``grace`` s.

    ``find`` is asked again while waiting, so processes started meanwhile are ended too. Exited
    children of this process among them are reaped. Returns every process that was signalled.
    """
    targets = find()
    if not targets:
        return targets
    _signal_processes(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while True:
        _reap(targets)
        alive = {p for p in targets if _alive(p)}
        new = find() - targets
        if new:
            _signal_processes(new, signal.SIGTERM)
            targets |= new
            alive |= new
        if not alive:
            return targets
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_INTERVAL)
    # Whatever ignored SIGTERM: SIGKILL until nothing is left (a fork bomb gets a bounded number of rounds).
    for _ in range(50):
        alive = {p for p in targets | find() if _alive(p)}
        if not alive:
            break
        targets |= alive
        _signal_processes(alive, signal.SIGKILL)
        time.sleep(0.02)
        _reap(targets)
    _reap(targets)
    return targets


class ProcessJobHandle(JobHandleSpec):
    """Handle of a trainer running as a local process group."""

    def __init__(
        self,
        job: SiteJob,
        proc: subprocess.Popen[str],
        sink: LineSink,
        handshake: Path | None,
        mark: str | None = None,
        adopt_orphans: bool = False,
        hidden: Iterable[str] = (),
    ) -> None:
        self.job = job
        self.proc = proc
        self._sink = sink
        self._handshake = handshake
        self._mark = mark
        self._adopt = adopt_orphans
        self._started = time.monotonic()
        self._terminated = False
        self._reason = ""
        self._lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._hidden: set[str] = {v for v in hidden if v}
        self._reader = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._reader.start()

    def _pump(self, stream: IO[str] | None) -> None:
        if stream is None:
            return
        for line in stream:
            text = line.rstrip("\n")
            for value in self._hidden:  # a trainer that prints a secret: the log shows ***
                text = text.replace(value, "***")
            if text.strip():
                self._tail.append(text)
            self._sink(text)
        stream.close()

    def hide(self, values: Iterable[str]) -> None:
        """Never repeat these strings (secrets in the trainer's environment) in its output lines
        from now on or in :attr:`reason` (pass them to the launcher to cover the first lines too)."""
        self._hidden.update(v for v in values if v)

    def last_output(self) -> str:
        """The trainer's last non-empty output line (shortened, secrets hidden), or ``""``."""
        if not self._tail:
            return ""
        line = self._tail[-1].strip()
        for value in self._hidden:
            line = line.replace(value, "***")
        return line if len(line) <= _TAIL_CHARS else line[: _TAIL_CHARS - 1] + "…"

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
        if self._reason:
            return self._reason
        state, _, reason = map_exit(self.proc.poll(), terminated=self._terminated)
        last = self.last_output() if state is JobState.FAILED else ""
        return f"{reason}; its last output: {last}" if last else reason

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

    def processes(self) -> set[int]:
        """The job's live processes besides the trainer itself (see the module docstring)."""
        leader = self.proc.pid
        roots = (leader, os.getpid()) if self._adopt else (leader,)
        return job_processes(roots=roots, sessions=(leader,), mark=self._mark, exclude=(leader,))

    def _finish(self, grace: float | None = None) -> None:
        # The leader has exited; whatever it started goes too, wherever it moved to.
        end_processes(self.processes, self.job.shutdown_timeout if grace is None else grace)
        self._reader.join(timeout=5)
        if self._handshake is not None:
            self._handshake.unlink(missing_ok=True)

    def _kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def terminate(self) -> None:
        """End the trainer and every process of its job: SIGTERM, SIGKILL after ``shutdown_timeout``."""
        with self._lock:
            if self.proc.poll() is not None:
                self._finish()
                return
            self._terminated = True
            deadline = time.monotonic() + self.job.shutdown_timeout
            # Its descendants are still linked to it now: signal them before they are orphaned.
            others = self.processes()
            self._kill_group(signal.SIGTERM)
            _signal_processes(others, signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.job.shutdown_timeout)
            except subprocess.TimeoutExpired:
                self._kill_group(signal.SIGKILL)
                self.proc.wait()
            self._finish(grace=max(0.0, deadline - time.monotonic()))


def check_environment(job: SiteJob) -> None:
    """Refuse variables no process can receive, naming the variable (never its value)."""
    for name, value in job.env.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise LaunchError(
                f"{job.label}: environment variable {name!r} must be a string with a string value, "
                f"got {type(value).__name__}; quote it in the site's launcher_spec.process.env"
            )
        if not name or "=" in name or "\0" in name:
            raise LaunchError(
                f"{job.label}: {name!r} cannot be an environment variable name (empty, '=' or a NUL byte); "
                "fix the site's launcher_spec.process.env"
            )
        if "\0" in value:
            raise LaunchError(
                f"{job.label}: the value of environment variable {name!r} contains a NUL byte, which no "
                "process environment can hold; fix it in the site's launcher_spec.process.env"
            )


def check_launchable(job: SiteJob, search_path: str) -> None:
    """Say what is wrong before starting: a missing working directory or trainer program.

    Without this check ``Popen`` reports a missing ``cwd`` as the program not being found.
    """
    cwd = job.cwd
    if cwd is not None:
        if not os.path.exists(cwd):
            raise LaunchError(
                f"{job.label}: cannot start the trainer: the working directory {cwd!r} does not exist "
                "on this host; "
                "create it or change the site's launcher_spec.process.cwd"
            )
        if not os.path.isdir(cwd):
            raise LaunchError(
                f"{job.label}: cannot start the trainer: the working directory {cwd!r} is not a directory; "
                "change the site's launcher_spec.process.cwd"
            )
        if not os.access(cwd, os.X_OK):
            raise LaunchError(
                f"{job.label}: cannot start the trainer: the working directory {cwd!r} cannot be entered "
                f"by this user (uid {os.getuid()}); "
                "fix its permissions or change the site's launcher_spec.process.cwd"
            )
    program = job.argv[0]
    if "/" not in program:
        if shutil.which(program, path=search_path) is None:
            raise LaunchError(
                f"{job.label}: cannot start {program!r}: the program was not found on PATH ({search_path}); "
                "install it, give its absolute path in trainer.command, or fix PATH in the site's env"
            )
        return
    path = os.path.join(cwd or os.getcwd(), program)
    if not os.path.exists(path):
        raise LaunchError(
            f"{job.label}: cannot start {program!r}: no such file"
            + (f" (relative to the working directory {cwd!r})" if not os.path.isabs(program) else "")
            + "; fix trainer.command or install the interpreter on this host"
        )
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise LaunchError(
            f"{job.label}: cannot start {program!r}: not an executable file; "
            "fix trainer.command (or make the file executable: chmod +x)"
        )


def _load_libc() -> Any:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process a child subreaper: orphaned descendants are reparented here, not to init.

    Then :func:`job_processes` with ``roots=(os.getpid(),)`` still sees a daemon that a trainer
    double-forked or ``setsid``-ed. Returns whether it worked (Linux only).
    """
    return _LIBC is not None and _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux only).

    Returns ``False`` also when the parent is already gone (this process was reparented): the
    caller should then stop as if it had received ``sig``.
    """
    parent = os.getppid()
    if _LIBC is None or _LIBC.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        return False
    return parent != 1 and os.getppid() == parent


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """SIGKILL the trainer if the launching process dies without terminating it (Linux)."""
    # Only a foreign call here: the child of a threaded parent must not import or allocate.
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _default_sink(line: str) -> None:
    print(line, flush=True)


class ProcessLauncher(JobLauncherSpec):
    """Launch site jobs as local processes (NVFlare's process launcher).

    :param sink: receives the trainer's output line by line (default: this process's stdout).
    :param prefix_lines: prefix each line with ``[site rN]``.
    :param adopt_orphans: for a process that runs one job and nothing else (the site runner):
        become a child subreaper and count every other descendant of this process as the job's,
        so that a daemon that left the job's session and scrubbed its environment still ends
        with the job.
    :param hidden: strings (secret values) replaced by ``***`` in every output line and reason.
    """

    def __init__(
        self,
        sink: LineSink | None = None,
        prefix_lines: bool = True,
        adopt_orphans: bool = False,
        hidden: Iterable[str] = (),
    ) -> None:
        self.sink = sink or _default_sink
        self.prefix_lines = prefix_lines
        self.adopt_orphans = adopt_orphans and become_subreaper()
        self.hidden = tuple(v for v in hidden if v)

    def launch_job(self, job_meta: SiteJob, fl_ctx: Mapping[str, Any] | None = None) -> ProcessJobHandle:
        if not job_meta.argv:
            raise LaunchError(f"{job_meta.label}: empty argv")
        check_environment(job_meta)
        handshake: Path | None = None
        mark = secrets.token_hex(16)
        extra = {**job_meta.env, TREE_MARK_ENV: mark}
        if job_meta.launch_timeout is not None:
            fd, name = tempfile.mkstemp(prefix="flare-handshake-")
            os.close(fd)
            handshake = Path(name)
            handshake.unlink()
            extra["FLARE_HANDSHAKE"] = str(handshake)
        env = trainer_environment(os.environ, extra)
        check_launchable(job_meta, env.get("PATH", os.defpath))
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
        except (OSError, ValueError) as exc:
            if handshake is not None:
                handshake.unlink(missing_ok=True)
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise LaunchError(f"{job_meta.label}: cannot start {job_meta.argv[0]!r}: {detail}") from exc
        return ProcessJobHandle(job_meta, proc, emit, handshake, mark, self.adopt_orphans, self.hidden)
