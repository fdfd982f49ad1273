"""`make airflow`: a local Airflow that answers, logs in, and leaves nothing on Ctrl-C."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import httpx

from flare_airflow_testing.local_airflow import BIN, REPO, assert_nothing_left, process_tree
from flare_airflow_testing.ports import free_port


def test_make_airflow_starts_and_ctrl_c_leaves_nothing(tmp_path: pathlib.Path) -> None:
    home = tmp_path / "airflow"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    log = tmp_path / "make-airflow.out"
    out = open(log, "wb")  # noqa: SIM115
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
        while "login:" not in (text := log.read_text(errors="replace")):
            assert proc.poll() is None, text
            assert time.monotonic() < deadline, f"make airflow did not come up:\n{text}"
            time.sleep(0.5)
        assert httpx.get(f"{base}/api/v2/monitor/health", timeout=5).status_code == 200
        assert f"Airflow is up: {base}/" in text
        password = text.split("login: admin / ")[1].split()[0]
        token = httpx.post(f"{base}/auth/token", json={"username": "admin", "password": password}, timeout=10)
        assert token.status_code == 201, token.text
        plugins = httpx.get(
            f"{base}/api/v2/plugins", headers={"Authorization": f"Bearer {token.json()['access_token']}"}, timeout=10
        ).json()
        assert "flare_airflow" in [p["name"] for p in plugins["plugins"]]  # what Admin -> Plugins lists
        listed = subprocess.run(
            [str(BIN / "airflow"), "plugins", "--output", "json"],
            env={**env, "AIRFLOW_HOME": str(home)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "flare_airflow.ui.plugin" in listed  # `airflow plugins` lists it
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
    text = log.read_text(errors="replace")
    print(text)
    assert "stopped; no process left" in text, text
    assert_nothing_left(tree, home, port)
