"""``make airflow``: a local Airflow 3 (api-server, scheduler, dag-processor, triggerer) on SQLite.

Bound to 127.0.0.1, with this repository's DAGs and the flare-airflow plugin (its entry point),
``[core] parallelism`` 4. Prints the URL and the login once the API answers. Ctrl-C (SIGINT) or
SIGTERM stops everything: each component gets SIGTERM for its whole process group, then whatever
is still alive among this process's descendants gets SIGKILL.

Why descendants and not only process groups: Airflow's task supervisor moves each task into a
process group of its own (``setpgid``) and a site trainer may start a session of its own, so
killing the components' groups can miss them. This process makes itself the *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``, Linux): every orphaned descendant is re-parented to it rather
than to PID 1, so walking the parent links from here finds all of them, however they detached.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
USER = "admin"
_PR_SET_CHILD_SUBREAPER = 36


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether a server could not listen on ``port`` now.

    ``SO_REUSEADDR``, as the api-server (uvicorn) binds: the connections of an Airflow just stopped
    linger in TIME_WAIT for about a minute, which a plain bind counts as in use while the
    api-server would start fine.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name (field 2) is in parentheses and may contain spaces.
        fields = stat[stat.rfind(")") + 2 :].split()
        found[int(entry)] = int(fields[1])
    return found


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children first listed before their own children)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def reap_orphans(keep: set[int]) -> int:
    """Collect the exit status of the orphans re-parented to this subreaper; returns how many.

    Airflow's tasks, their sandboxes (``bwrap``) and trainers that detached end as this process's
    children once their parent is gone; unreaped they stay ``<defunct>`` until the stop. The
    components (``keep``) are left to their ``Popen``, which needs their status.
    """
    reaped = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in keep:
            continue
        try:
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]
        if state == "Z" and int(ppid) == os.getpid():
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(int(pid), os.WNOHANG)[0]:
                    reaped += 1
    return reaped


def stop_all(procs: dict[str, subprocess.Popen[bytes]], grace: float = 20.0) -> None:
    """SIGTERM each component's process group, wait up to ``grace`` s, then SIGKILL what remains."""
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap()
        if all(p.poll() is not None for p in procs.values()) and not descendants(os.getpid()):
            return
        time.sleep(0.2)
    for _ in range(50):
        left = descendants(os.getpid())
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
        _reap()
        for p in procs.values():
            p.poll()


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/api/v2/monitor/health", timeout=2) as resp:  # noqa: S310 - loopback
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: pathlib.Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def environment(home: pathlib.Path, port: int) -> dict[str, str]:
    base = f"http://127.0.0.1:{port}"
    return {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__AUTH_MANAGER": os.environ.get(
            "AIRFLOW__CORE__AUTH_MANAGER",
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        ),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": os.environ.get(
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", f"{USER}:admin"
        ),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{base}/execution/",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": base,
        # The log servers of workers and triggerer default to 8793/8794, which another Airflow on
        # the machine may hold.
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
    }


def password_file(home: pathlib.Path, env: dict[str, str]) -> pathlib.Path:
    configured = env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE")
    return pathlib.Path(configured) if configured else home / "simple_auth_manager_passwords.json.generated"


def login_lines(home: pathlib.Path, env: dict[str, str]) -> Iterator[str]:
    path = password_file(home, env)
    try:
        passwords = json.loads(path.read_text())
    except (OSError, ValueError):
        yield f"login: the users' passwords are in {path}"
        return
    for user, password in sorted(passwords.items()):
        yield f"login: {user} / {password}   (from {path})"


class _Stop(Exception):
    pass


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make airflow", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8080, help="API server port on 127.0.0.1 (default 8080)")
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    args = parser.parse_args(argv)
    home = pathlib.Path(os.environ.get("AIRFLOW_HOME", "~/airflow")).expanduser().resolve()
    if port_in_use(args.port):
        print(
            f"port {args.port} on 127.0.0.1 is in use (another Airflow?); choose another: make airflow AIRFLOW_PORT=N",
            file=sys.stderr,
        )
        return 2
    env = environment(home, args.port)
    airflow = str(pathlib.Path(sys.executable).with_name("airflow"))
    logs = home / "local"
    logs.mkdir(parents=True, exist_ok=True)
    become_subreaper()
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    base = f"http://127.0.0.1:{args.port}"
    code = 0
    try:
        for name in COMPONENTS:
            with open(logs / f"{name}.log", "ab") as log:
                # A session of its own: the terminal's Ctrl-C reaches this process only, which
                # then stops the components in order.
                procs[name] = subprocess.Popen(
                    [airflow, name], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        print(f"starting Airflow (api-server, scheduler, dag-processor, triggerer); logs: {logs}/<component>.log")
        deadline = time.monotonic() + args.startup_timeout
        ready = False
        while True:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    print(f"{name} exited with {proc.returncode}:\n{_tail(logs / f'{name}.log')}", file=sys.stderr)
                    return 1
            if not ready and _healthy(base):
                ready = True
                print(f"\nAirflow is up: {base}/  (Federated runs: {base}/flare/)")
                for line in login_lines(home, env):
                    print(line)
                print(f"DAGs folder: {env.get('AIRFLOW__CORE__DAGS_FOLDER', home / 'dags')}; Ctrl-C stops everything.")
                sys.stdout.flush()
            reap_orphans({p.pid for p in procs.values()})
            if not ready and time.monotonic() > deadline:
                print(f"the API server did not answer within {args.startup_timeout:.0f} s", file=sys.stderr)
                return 1
            time.sleep(1)
    except _Stop as stop:
        print(f"\n{stop}: stopping Airflow ...", flush=True)
        code = 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(procs)
        left = descendants(os.getpid())
        print("stopped; no process left" if not left else f"processes still alive: {left}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
