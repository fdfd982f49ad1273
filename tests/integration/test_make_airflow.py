"""`make airflow`: a local Airflow that answers, lists the plugin, and leaves nothing on Ctrl-C."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import time

import httpx

from tests.stack import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]


def _started(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): tells a pid from a later reuse of it."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]


def process_tree(root: int) -> dict[int, str]:
    """root and every process below it: pid -> start time."""
    children: dict[int, list[int]] = {}
    for pid in descendants_scan():
        children.setdefault(pid[1], []).append(pid[0])
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if (started := _started(pid)) is not None:
            found[pid] = started
        todo.extend(children.get(pid, []))
    return found


def descendants_scan() -> list[tuple[int, int]]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            out.append((int(entry), int(stat[stat.rfind(")") + 2 :].split()[1])))
    return out


def processes_with_home(home: pathlib.Path) -> list[tuple[int, str]]:
    """Processes whose environment has AIRFLOW_HOME=home (those that did not overwrite their
    environment with a process title, as the api-server does)."""
    marker = f"AIRFLOW_HOME={home}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = pathlib.Path(f"/proc/{entry}/environ").read_bytes()
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append((int(entry), cmdline))
    return found


def test_make_airflow_starts_and_ctrl_c_leaves_nothing(tmp_path: pathlib.Path) -> None:
    home = tmp_path / "airflow"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    out = open(tmp_path / "make-airflow.out", "wb")  # noqa: SIM115
    # Its own session and process group, as a terminal runs a foreground job: Ctrl-C signals the group.
    proc = subprocess.Popen(
        ["make", "-s", "-C", str(REPO), "airflow", f"AIRFLOW_HOME={home}", f"AIRFLOW_PORT={port}"],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "make-airflow.out").read_text()
            try:
                if httpx.get(f"{base}/api/v2/monitor/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise AssertionError(
                "no answer from /api/v2/monitor/health:\n" + (tmp_path / "make-airflow.out").read_text(errors="replace")
            )
        deadline = time.monotonic() + 20
        while "login:" not in (text := (tmp_path / "make-airflow.out").read_text()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert f"Airflow is up: {base}/" in text
        assert "login: admin / " in text
        password = text.split("login: admin / ")[1].split()[0]
        token = httpx.post(f"{base}/auth/token", json={"username": "admin", "password": password}, timeout=10)
        assert token.status_code == 201, token.text
        tree = process_tree(proc.pid)
        names = " ".join(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid in tree)
        for component in ("api_server", "scheduler", "dag-processor", "triggerer"):
            assert component in names, names
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # the test failed before Ctrl-C: stop it the same way, then harder
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.close()
    text = (tmp_path / "make-airflow.out").read_text()
    print(text)
    assert "stopped; no process left" in text, text
    deadline = time.monotonic() + 5
    while (left := processes_with_home(home)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"processes left after Ctrl-C: {left}"
    alive = {pid for pid, started in tree.items() if _started(pid) == started}
    assert alive == set(), f"processes of make airflow still alive after Ctrl-C: {sorted(alive)}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing holds the API port any more
