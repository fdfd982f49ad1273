"""`make airflow`'s launcher (``python -m flare_airflow.ui.local``) as a test fixture, and the
process checks that prove it leaves nothing behind."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from flare_airflow_testing.ports import free_port

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def started(pid: int) -> str | None:
    """The process's start time (/proc/PID/stat field 22): tells a pid from a later reuse of it."""
    fields = _stat_fields(pid)
    return None if fields is None or fields[0] in ("Z", "X") else fields[19]


def process_tree(root: int) -> dict[int, str]:
    """``root`` and every live process below it: pid -> start time."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if (when := started(pid)) is not None:
            found[pid] = when
        todo.extend(children.get(pid, []))
    return found


def processes_with_home(home: pathlib.Path) -> list[tuple[int, str]]:
    """Live processes whose environment has AIRFLOW_HOME=home (those that did not overwrite their
    environment with a process title, as the api-server does: see :func:`process_tree`)."""
    marker = f"AIRFLOW_HOME={home}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or started(int(entry)) is None:
            continue
        try:
            environ = pathlib.Path(f"/proc/{entry}/environ").read_bytes()
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append((int(entry), cmdline))
    return found


def assert_nothing_left(tree: dict[int, str], home: pathlib.Path, port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = sorted(pid for pid, when in tree.items() if started(pid) == when)
        left = processes_with_home(home)
        if not alive and not left:
            break
        time.sleep(0.2)
    assert not alive, f"processes still alive after the stop: {alive}"
    assert not left, f"processes of {home} still alive after the stop: {left}"
    with socket.socket() as s:
        # SO_REUSEADDR, as a server sets it: connections in TIME_WAIT do not count, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # nothing listens on the API port any more


class LocalAirflow:
    """The launcher on a free port with its own AIRFLOW_HOME; stopped with SIGINT, as Ctrl-C does."""

    def __init__(self, root: pathlib.Path, dags: pathlib.Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.home = root / "airflow"
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
            "PYTHONWARNINGS": "ignore::DeprecationWarning",
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.tree: dict[int, str] = {}
        self.out = root / "launcher.out"

    def start(self, timeout: float = 180) -> None:
        subprocess.run([str(BIN / "airflow"), "db", "migrate"], env=self.env, check=True, capture_output=True, cwd=REPO)
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [str(BIN / "python"), "-m", "flare_airflow.ui.local", "--port", str(self.port)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=REPO,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.out.read_text(errors="replace")
            if "login:" in self.out.read_text(errors="replace"):
                return
            time.sleep(0.5)
        raise AssertionError(f"Airflow did not come up in {timeout} s:\n{self.out.read_text(errors='replace')}")

    def token(self, user: str, password: str) -> str:
        r = httpx.post(f"{self.base}/auth/token", json={"username": user, "password": password}, timeout=10)
        assert r.status_code == 201, r.text
        return str(r.json()["access_token"])

    def stop(self) -> str:
        """SIGINT to the launcher's group (Ctrl-C); returns its output; asserts nothing is left."""
        assert self.proc is not None
        self.tree = process_tree(self.proc.pid)
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        text = self.out.read_text(errors="replace")
        assert "stopped; no process left" in text, text
        assert_nothing_left(self.tree, self.home, self.port)
        return text


class Api:
    """Airflow's REST API as one user."""

    def __init__(self, base: str, token: str) -> None:
        self.base, self.token = base, token

    def __call__(self, method: str, path: str, **kw: Any) -> Any:
        # A GET is asked again when a loaded machine keeps the API from answering in time; anything
        # else is not idempotent and is asked once.
        tries = 3 if method == "GET" else 1
        for attempt in range(1, tries + 1):
            try:
                r = httpx.request(
                    method,
                    f"{self.base}/api/v2{path}",
                    headers={"Authorization": f"Bearer {self.token}"},
                    # A write is asked once: give it the time a loaded api-server needs.
                    timeout=30 if method == "GET" else 120,
                    **kw,
                )
                break
            except httpx.TimeoutException:
                if attempt == tries:
                    raise
        assert r.status_code < 400, f"{method} {path}: {r.status_code} {r.text}"
        return r.json() if r.content else None

    def trigger(self, dag_id: str, conf: dict[str, Any], timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = httpx.get(
                    f"{self.base}/api/v2/dags/{dag_id}", headers={"Authorization": f"Bearer {self.token}"}, timeout=30
                )
            except httpx.TimeoutException:  # a loaded api-server: ask again until the deadline
                r = None
            if r is not None and r.status_code == 200:
                break
            assert time.monotonic() < deadline, f"DAG {dag_id} not parsed: {self('GET', '/importErrors')}"
            time.sleep(1)
        self("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
        return str(self("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})["dag_run_id"])

    def wait(self, dag_id: str, run_id: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
            if state in ("success", "failed"):
                return str(state)
            time.sleep(1)
        raise AssertionError(f"run {run_id} of {dag_id} did not finish in {timeout} s")

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        body = self("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        assert body["total_entries"] <= 100
        return {ti["task_id"]: ti["state"] for ti in body["task_instances"]}
