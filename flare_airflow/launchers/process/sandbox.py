"""Confinement of a process trainer with bubblewrap (``bwrap``): what it may write, see and reach.

A confined trainer sees the host's file system read-only, except its own output directory
(``FLARE_OUTPUT``'s, the try's staging directory), the directories the site admin lists in
``confinement.writable``, and a private ``/tmp`` (and ``$TMPDIR``) that vanishes with it. Its input
global model is read-only, so it cannot change what the other sites of the round read. It has its
own PID namespace (it cannot see or signal the worker's processes, and everything it started dies
with it), its own IPC namespace, its own user namespace in which it is ``nobody`` with no capability
(so even a worker running as root gives it none: no mount, no new namespaces, no raw sockets, no
setuid gain), no ``ptrace`` (:mod:`.seccomp`), a minimal ``/dev`` with the host's GPU devices passed through, and
-- when the site policy says ``network: false`` -- no network but its own loopback.

Why bubblewrap and not Landlock: bwrap gives the PID namespace (the end of the trainer ends all it
started, even a daemon that left its session), the private ``/tmp`` and the network namespace in
one exec, on every kernel that has user namespaces, as root or not; Landlock restricts writes only
(network rules need Linux 6.7 and ABI 4), needs no mount, but cannot hide ``/tmp`` or end a
trainer's daemons. The cost is one extra exec and namespace setup per site job (measured in
``benchmarks/results/confinement.md``).

The rest of the launcher is unchanged: the environment is passed as is (bwrap keeps it), the
handle still ends the whole tree. bwrap reports a trainer killed by signal N as exit code 128+N,
which :func:`sandboxed_exit` maps back to the signal for the state table.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.process.seccomp import filter_fd

BWRAP = "bwrap"
# The GPU devices a trainer may need (NVIDIA, and DRM render nodes for others), passed through as is.
GPU_DEVICE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps", "/dev/dri")
MODES = ("auto", "required", "off")
_SIGNAL_EXIT_BASE = 128
# The mount point of the trainer's private temporary directory (a fresh tmpfs, not the host's).
PRIVATE_TMP = "/tmp"  # noqa: S108
_PROBE_TIMEOUT = 20.0
# The trainer's uid and gid inside its user namespace: nobody/nogroup, an unprivileged id. Outside,
# its files stay the worker's (the namespace maps this id to the worker's uid, and only that one).
SANDBOX_UID = 65534


class ConfinementUnavailable(Exception):
    """This host cannot confine trainers (no bwrap, or no namespaces); the message says why and what to do."""


@dataclass(frozen=True)
class Confinement:
    """How one site job's trainer is confined: the site policy's ``confinement`` block, resolved.

    :param mode: ``auto`` (confine where the host can, else run unconfined with a warning),
        ``required`` (refuse to run unconfined) or ``off`` (run as the worker's user, unconfined).
    :param network: ``False``: no network but the trainer's own loopback.
    :param writable: directories the trainer may write besides its output directory and ``/tmp``.
    :param devices: device nodes passed through besides the GPUs found on the host.
    """

    mode: str = "auto"
    network: bool = True
    writable: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Confinement:
        """From the JSON a site run carries (``None``: the default, ``auto``)."""
        if not data:
            return cls()
        return cls(
            mode=str(data.get("mode", "auto")),
            network=bool(data.get("network", True)),
            writable=tuple(data.get("writable") or ()),
            devices=tuple(data.get("devices") or ()),
        )

    @property
    def wanted(self) -> bool:
        return self.mode != "off"


def _bwrap_base(network: bool, seccomp_fd: int) -> list[str]:
    # --unshare-user --uid/--gid: the trainer is nobody in a user namespace of its own, and
    # --cap-drop ALL leaves it no capability even there. A worker running as root (the usual case:
    # CI, compose, containers) would otherwise hand the trainer every capability, and with them
    # `mount -o remount,rw /`. The namespace maps only the trainer's uid, to the worker's, so files
    # it writes are the worker's as before. --disable-userns: it cannot make a nested user namespace
    # (where it would be root again). bwrap always sets no-new-privs, and mounts nosuid.
    # --die-with-parent: the sandbox (and everything in its PID namespace) is SIGKILLed when the
    # launcher dies, kill -9 included. --new-session: the trainer gets its own session and group,
    # apart from bwrap's, so terminate() can SIGTERM it and give it its grace period (a SIGTERM to
    # bwrap itself would end the namespace at once).
    uid = str(SANDBOX_UID)
    argv = [
        "--die-with-parent",
        "--unshare-user",
        "--uid",
        uid,
        "--gid",
        uid,
        "--disable-userns",
        "--cap-drop",
        "ALL",
        "--seccomp",
        str(seccomp_fd),
        "--unshare-pid",
        "--unshare-ipc",
        "--new-session",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        PRIVATE_TMP,
    ]
    if not network:
        argv.append("--unshare-net")
    return argv


@functools.cache
def _probe(bwrap: str) -> str | None:
    try:
        fd = filter_fd()
        try:
            out = subprocess.run(
                [bwrap, *_bwrap_base(network=False, seccomp_fd=fd), "--", "/bin/true"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=_PROBE_TIMEOUT,
                check=False,
                pass_fds=(fd,),
            )
        finally:
            os.close(fd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{bwrap} could not be run ({exc})"
    if out.returncode != 0:
        detail = " ".join(out.stderr.split())[:300] or f"exit code {out.returncode}"
        if "Unknown option" in out.stderr:
            return (
                f"{bwrap} is older than bubblewrap 0.8 ({detail}); install bubblewrap 0.8 or later "
                "(Debian 12, Ubuntu 24.04)"
            )
        return f"{bwrap} cannot create a sandbox on this host ({detail}); user namespaces may be disabled"
    return None


def find_bwrap(search_path: str | None = None) -> str:
    """The usable ``bwrap`` on ``search_path`` (default ``$PATH``), probed once per process.

    Raises :class:`ConfinementUnavailable` saying why this host cannot confine trainers.
    """
    bwrap = shutil.which(BWRAP, path=search_path if search_path is not None else os.environ.get("PATH", os.defpath))
    if bwrap is None:
        raise ConfinementUnavailable(
            "bubblewrap (bwrap) is not installed on this host (Debian/Ubuntu: apt-get install bubblewrap)"
        )
    problem = _probe(bwrap)
    if problem is not None:
        raise ConfinementUnavailable(problem)
    return bwrap


def host_devices(extra: Iterable[str] = ()) -> list[str]:
    """The device nodes a confined trainer gets from the host: the GPUs found here, and ``extra``."""
    found = [p for pattern in GPU_DEVICE_GLOBS for p in sorted(glob.glob(pattern))]
    return list(dict.fromkeys([*found, *(p for p in extra if os.path.exists(p))]))


@dataclass(frozen=True)
class Sandbox:
    """One site job's sandbox: the probed ``bwrap``, the site's confinement, and the job's own paths.

    :param writable: the directories this job writes (its output directory), made before the launch.
    :param read_only: files kept read-only even inside a writable directory (the input global model).
    """

    bwrap: str
    confinement: Confinement
    writable: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()

    def argv(
        self,
        argv: Sequence[str],
        cwd: str | None,
        env: Mapping[str, str],
        also_writable: Iterable[str] = (),
        *,
        seccomp_fd: int,
    ) -> list[str]:
        """The exact argv that runs ``argv`` confined (never a shell string); bwrap reads the
        seccomp filter from ``seccomp_fd`` (:func:`~.seccomp.filter_fd`, passed to the child).

        Order matters to bwrap: the read-only root first, then private temporary directories and
        the writable directories over it, then the read-only files over those.

        Raises :class:`LaunchError` for a ``TMPDIR`` whose private tmpfs would hide what the
        trainer needs (``/``, or a directory holding its program, working or output directory).
        """
        writable = list(dict.fromkeys([*self.writable, *self.confinement.writable, *also_writable]))
        out = [self.bwrap, *_bwrap_base(self.confinement.network, seccomp_fd)]
        for device in host_devices(self.confinement.devices):
            out += ["--dev-bind", device, device]
        for entry in tmp_entries_named(argv, cwd, env):
            out += ["--ro-bind", entry, entry]
        tmpdir = env.get("TMPDIR")
        if tmpdir and os.path.isabs(tmpdir) and os.path.isdir(tmpdir) and os.path.realpath(tmpdir) != PRIVATE_TMP:
            _check_private_tmpdir(tmpdir, [*argv[:2], cwd or os.getcwd()], writable)
            out += ["--tmpfs", tmpdir]  # the trainer's TMPDIR stays what it was, and private
        for path in writable:
            out += ["--bind", path, path]
        for path in self.read_only:
            if os.path.exists(path):
                out += ["--ro-bind", path, path]
        out += ["--chdir", cwd or os.getcwd(), "--", *argv]
        return out


def _check_private_tmpdir(tmpdir: str, needed: Iterable[str], rebound: Iterable[str]) -> None:
    """A confined trainer's ``$TMPDIR`` becomes an empty private tmpfs: refuse one that would hide
    the host's root or a path the trainer needs, its program or working directory (bwrap would fail
    with a bare mount error, or the trainer would not find its program). The ``rebound`` (writable)
    directories are bound again over the tmpfs, so they may lie under it."""
    real = os.path.realpath(tmpdir)
    over = [os.path.realpath(r) for r in rebound]
    hidden = [
        p
        for p in needed
        if p
        and os.path.isabs(p)
        and _under(os.path.realpath(p), real)
        and not any(_under(os.path.realpath(p), r) for r in over)
    ]
    if real == "/" or hidden:
        what = "the whole file system" if real == "/" else ", ".join(dict.fromkeys(hidden))
        raise LaunchError(
            f"TMPDIR={tmpdir!r} cannot be a confined trainer's temporary directory: it becomes an empty "
            f"private tmpfs, which would hide {what}; set TMPDIR to /tmp or a directory of its own (or unset it) "
            "in the site's launcher_spec.process.env"
        )


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def tmp_entries_named(argv: Sequence[str], cwd: str | None, env: Mapping[str, str]) -> list[str]:
    """The host's ``/tmp/<entry>`` directories that hold a path the job names (its program, script,
    working directory, an environment value such as ``PYTHONPATH``): shown read-only over the
    private ``/tmp``, or a trainer kept there (a test's temporary directory) would vanish."""
    named = [*argv, cwd or os.getcwd(), *(part for value in env.values() for part in value.split(os.pathsep))]
    prefix = PRIVATE_TMP + "/"
    found: dict[str, None] = {}
    for path in named:
        if not path.startswith(prefix) or ".." in path.split("/"):
            continue
        entry = prefix + path[len(prefix) :].split("/", 1)[0]
        if entry != prefix and os.path.isdir(entry) and not os.path.islink(entry):
            found[entry] = None
    return list(found)


def sandboxed_exit(code: int | None) -> int | None:
    """bwrap's exit status as the trainer's: 128+N (bwrap's report of signal N) becomes ``-N``."""
    if code is not None and _SIGNAL_EXIT_BASE < code <= _SIGNAL_EXIT_BASE + 64:
        return _SIGNAL_EXIT_BASE - code
    return code
