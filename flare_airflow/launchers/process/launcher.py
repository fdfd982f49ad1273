"""Process launcher: a site job is a local process started from an exact argv (never a shell).

The trainer runs in its own session and process group, and carries a random job mark in its
environment (``FLARE_PROCESS_TREE``) that its descendants inherit. When the trainer ends, or
``terminate()`` is called, every process of the job that this process can see is ended
(:mod:`flare_airflow.launchers.process.tree`). Output streams line by line to a sink (the Airflow
task log when run from a site task). Exit codes and signals map to ``JobReturnCode`` in
:func:`~flare_airflow.core.exit_codes.map_exit`. Given a
:class:`~flare_airflow.launchers.process.sandbox.Sandbox`, the trainer runs confined by bubblewrap.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from flare_airflow.core.envvars import FLARE_HANDSHAKE
from flare_airflow.core.exit_codes import map_exit
from flare_airflow.core.spec import (
    JobHandleSpec,
    JobIdentity,
    JobLauncherSpec,
    JobReturnCode,
    JobState,
    LineSink,
    SiteJob,
)
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.process.environment import check_environment, check_launchable, trainer_environment
from flare_airflow.launchers.process.naming import TREE_MARK_ENV, new_tree_mark
from flare_airflow.launchers.process.sandbox import Sandbox, sandboxed_exit
from flare_airflow.launchers.process.seccomp import filter_fd
from flare_airflow.launchers.process.tree import (
    POLL_INTERVAL,
    become_subreaper,
    child_preexec,
    children,
    end_processes,
    job_processes,
    signal_processes,
)
from flare_airflow.launchers.trainer import output_prefix

_TAIL_LINES = 20
_TAIL_CHARS = 300
# Also the process site task's result file (operators/site.py): its task process, killed with
# SIGKILL, cannot remove it; the next launch on the host does.
_SCRATCH_KINDS = ("flare-sandbox-", "flare-handshake-", "flare-site-result-")


def scratch_prefix(kind: str) -> str:
    """A scratch entry's name starts with its launcher's PID, so a later launch on this host can
    tell the entries of a launcher that died by SIGKILL (which cleans up nothing) from live ones."""
    return f"{kind}{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_scratch(tmp: str | None = None) -> list[Path]:
    """Remove the temporary directory's scratch entries (sandbox directories, handshake files) of
    launchers that are no longer running; returns what was removed. A live PID -- the launcher, or
    an unrelated process that reused its number -- keeps its entries: never remove what may be in use."""
    removed: list[Path] = []
    root = Path(tmp or tempfile.gettempdir())
    for kind in _SCRATCH_KINDS:
        for entry in root.glob(f"{kind}*-*"):
            pid = entry.name[len(kind) :].split("-", 1)[0]
            if not pid.isdigit() or _pid_alive(int(pid)):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


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
        sandbox_dir: Path | None = None,
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
        # Confined (bwrap): the leader is bwrap, the trainer runs in its PID namespace; this private
        # directory (the handshake's) is removed when the job ends.
        self._sandbox_dir = sandbox_dir
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

    @property
    def confined(self) -> bool:
        return self._sandbox_dir is not None

    def _exit_status(self) -> int | None:
        """The trainer's exit status (``None`` while it runs), as if it had not been confined."""
        code = self.proc.poll()
        return sandboxed_exit(code) if self.confined else code

    def poll(self) -> JobReturnCode:
        code = self._exit_status()
        if code is None:
            self._check_launch_timeout()
            code = self._exit_status()
        return map_exit(code, terminated=self._terminated)[1]

    @property
    def state(self) -> JobState:
        return map_exit(self._exit_status(), terminated=self._terminated)[0]

    @property
    def reason(self) -> str:
        if self._reason:
            return self._reason
        state, _, reason = map_exit(self._exit_status(), terminated=self._terminated)
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
            step = POLL_INTERVAL if self._launch_pending() else None
            if deadline is not None:
                remaining = max(0.0, deadline - time.monotonic())
                step = remaining if step is None else min(step, remaining)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=step)

    def processes(self) -> set[int]:
        """The job's live processes besides the trainer itself (see :mod:`flare_airflow.launchers.process.tree`)."""
        leader = self.proc.pid
        roots = (leader, os.getpid()) if self._adopt else (leader,)
        return job_processes(roots=roots, sessions=(leader,), mark=self._mark, exclude=(leader,))

    def _finish(self, grace: float | None = None) -> None:
        # The leader has exited; whatever it started goes too, wherever it moved to.
        end_processes(self.processes, self.job.shutdown_timeout if grace is None else grace)
        self._reader.join(timeout=5)
        if self._handshake is not None:
            self._handshake.unlink(missing_ok=True)
        if self._sandbox_dir is not None:
            shutil.rmtree(self._sandbox_dir, ignore_errors=True)

    def _sandbox_processes(self) -> set[int]:
        """bwrap itself: the leader and the PID namespace's init (its child), which ends the
        namespace when the trainer ends."""
        leader = self.proc.pid
        return {leader, *children(leader)}

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
            if self.confined:
                # Not bwrap: its death would SIGKILL the namespace (--die-with-parent) and take the
                # trainer's grace period. The trainer has its own group (--new-session); bwrap
                # exits when it does.
                signal_processes(others - self._sandbox_processes(), signal.SIGTERM)
            else:
                self._kill_group(signal.SIGTERM)
                signal_processes(others, signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.job.shutdown_timeout)
            except subprocess.TimeoutExpired:
                self._kill_group(signal.SIGKILL)
                self.proc.wait()
            self._finish(grace=max(0.0, deadline - time.monotonic()))


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

    def launch_job(
        self, job_meta: SiteJob, fl_ctx: Mapping[str, Any] | None = None, *, sandbox: Sandbox | None = None
    ) -> ProcessJobHandle:
        """Start the trainer; with ``sandbox``, confined by bubblewrap (:mod:`.sandbox`)."""
        if not job_meta.argv:
            raise LaunchError(f"{job_meta.label}: empty argv")
        check_environment(job_meta)
        handshake: Path | None = None
        mark = new_tree_mark()
        extra = {**job_meta.env, TREE_MARK_ENV: mark}
        sandbox_dir: Path | None = None
        sweep_scratch()
        if sandbox is not None:
            # The handshake goes where the launcher sees it: the trainer's /tmp is its own.
            sandbox_dir = Path(tempfile.mkdtemp(prefix=scratch_prefix("flare-sandbox-")))
            handshake = sandbox_dir / "handshake"
        elif job_meta.launch_timeout is not None:
            fd, name = tempfile.mkstemp(prefix=scratch_prefix("flare-handshake-"))
            os.close(fd)
            handshake = Path(name)
            handshake.unlink()
        if job_meta.launch_timeout is not None and handshake is not None:
            extra[FLARE_HANDSHAKE] = str(handshake)
        else:
            handshake = None
        env = trainer_environment(os.environ, extra)
        check_launchable(job_meta, env.get("PATH", os.defpath))
        argv = list(job_meta.argv)
        seccomp_fd: int | None = None
        if sandbox is not None and sandbox_dir is not None:
            try:
                seccomp_fd = filter_fd()
                argv = sandbox.argv(argv, job_meta.cwd, env, also_writable=(str(sandbox_dir),), seccomp_fd=seccomp_fd)
            except LaunchError as exc:
                if seccomp_fd is not None:
                    os.close(seccomp_fd)
                shutil.rmtree(sandbox_dir, ignore_errors=True)
                raise LaunchError(f"{job_meta.label}: {exc}") from None
        prefix = output_prefix(job_meta) if self.prefix_lines else ""
        sink = self.sink

        def emit(line: str) -> None:
            sink(prefix + line)

        try:
            proc = subprocess.Popen(
                argv,
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
                pass_fds=() if seccomp_fd is None else (seccomp_fd,),
                preexec_fn=child_preexec(),
            )
        except (OSError, ValueError) as exc:
            if handshake is not None:
                handshake.unlink(missing_ok=True)
            if sandbox_dir is not None:
                shutil.rmtree(sandbox_dir, ignore_errors=True)
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise LaunchError(f"{job_meta.label}: cannot start {job_meta.argv[0]!r}: {detail}") from exc
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)  # bwrap has its copy (it reads the filter before the trainer starts)
        return ProcessJobHandle(
            job_meta, proc, emit, handshake, mark, self.adopt_orphans, self.hidden, sandbox_dir=sandbox_dir
        )

    def find_job(self, identity: JobIdentity) -> ProcessJobHandle | None:
        """Never possible: a process site job is a child of the task that launched it and ends with
        that task (its owners, ``PR_SET_PDEATHSIG``, the process-tree sweep), so no other process
        can re-attach to it -- by design, a process job never outlives its task. Watching one from a
        separate task would need a per-host supervisor that owns the jobs instead; there is none."""
        raise NotImplementedError(
            f"{identity.label}: a process site job ends with the task that launched it and cannot be found again "
            "from another task; process sites run launch and watch in one task (the fused site task)"
        )
