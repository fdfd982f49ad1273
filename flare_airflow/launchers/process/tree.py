"""The processes of a local site job as ``/proc`` shows them, and how they are ended (Linux).

A job's processes are the trainer's descendants, its session and group, processes that left
them (``setsid``, double fork) but still carry the job mark (``FLARE_PROCESS_TREE``) and -- in a
child subreaper such as the site runner -- orphans that were reparented here. They are ended
with SIGTERM to each one's group first, SIGKILL after a grace period. Also here: the ``prctl``
switches (child subreaper, die with the parent) and a process's start time, which tells a
reused pid apart.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from flare_airflow.launchers.process.naming import tree_mark_entry

POLL_INTERVAL = 0.05


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` from the state (field 3) on, or ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rfind(b")") + 2 :].split()


def _stat(pid: int) -> tuple[int, int, int, str] | None:
    """``(ppid, pgrp, session, state)`` of a process, or ``None`` once it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return int(fields[1]), int(fields[2]), int(fields[3]), fields[0].decode()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart), or ``None``
    when it is gone or a zombie."""
    fields = _stat_fields(pid)
    return None if fields is None or fields[0] in (b"Z", b"X") else int(fields[19])


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
    needle = tree_mark_entry(mark) if mark else None
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


def children(pid: int) -> set[int]:
    """The live direct children of ``pid`` (Linux; elsewhere an empty set)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return set()
    stats = {int(n): _stat(int(n)) for n in names if n.isdigit()}
    return {child for child, st in stats.items() if st is not None and st[0] == pid and st[3] not in ("Z", "X")}


def signal_processes(pids: Iterable[int], sig: int) -> None:
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
    signal_processes(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while True:
        _reap(targets)
        alive = {p for p in targets if _alive(p)}
        new = find() - targets
        if new:
            signal_processes(new, signal.SIGTERM)
            targets |= new
            alive |= new
        if not alive:
            return targets
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_INTERVAL)
    # Whatever ignored SIGTERM: SIGKILL until nothing is left (a fork bomb gets a bounded number of rounds).
    for _ in range(50):
        alive = {p for p in targets | find() if _alive(p)}
        if not alive:
            break
        targets |= alive
        signal_processes(alive, signal.SIGKILL)
        time.sleep(0.02)
        _reap(targets)
    _reap(targets)
    return targets


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


def child_preexec() -> Callable[[], None] | None:
    """What a launcher runs in its trainer between fork and exec: die with the launcher (Linux), or ``None``."""
    return _die_with_parent if _LIBC is not None else None
