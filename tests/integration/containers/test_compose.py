"""docker/compose.yaml brought up with podman-compose: the demo DAG triggered through the REST API
runs to success in containers, and ``down -v`` leaves no container, network or volume behind."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from flare_airflow_testing.containers import engine
from flare_airflow_testing.ports import free_port

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
PODMAN_COMPOSE = Path(sys.executable).with_name("podman-compose")
DAG_ID = "flare_digits"
ROUNDS = 2  # of the demo's 5: rounds 3-5 are skipped, which the states below check too
UP_TIMEOUT = 240  # s: images present; PostgreSQL, the migration and the api-server start (~60 s measured)
RUN_TIMEOUT = 300  # s: the run (~60 s measured)


class Compose:
    def __init__(self, project: str, env: dict[str, str]) -> None:
        self.project = project
        self.env = env

    def __call__(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(PODMAN_COMPOSE), "-p", self.project, "-f", str(COMPOSE_FILE), *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=io.podman.compose.project={self.project}"
        kinds = {
            "containers": ["ps", "-a", "--filter", label, "--format", "{{.Names}}"],
            "networks": ["network", "ls", "--filter", label, "--format", "{{.Name}}"],
            "volumes": ["volume", "ls", "--filter", label, "--format", "{{.Name}}"],
            "pods": ["pod", "ps", "--filter", f"name={self.project}", "--format", "{{.Name}}"],
        }
        return {
            kind: subprocess.run([engine(), *argv], capture_output=True, text=True, check=True).stdout.split()
            for kind, argv in kinds.items()
        }


class Api:
    def __init__(self, base: str, password: str) -> None:
        self.base = base
        r = httpx.post(f"{base}/auth/token", json={"username": "admin", "password": password}, timeout=10)
        r.raise_for_status()
        self.headers = {"Authorization": f"Bearer {r.json()['access_token']}"}

    def __call__(self, method: str, path: str, **kw: Any) -> Any:
        r = httpx.request(method, f"{self.base}/api/v2{path}", headers=self.headers, timeout=30, **kw)
        assert r.status_code < 400, f"{method} {path}: {r.status_code} {r.text}"
        return r.json() if r.content else None


def _wait_for_api(base: str, compose: Compose) -> None:
    deadline = time.monotonic() + UP_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/api/v2/monitor/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"the api-server did not answer in {UP_TIMEOUT} s:\n{compose('logs').stdout[-6000:]}")


def _wait_for_dag(api: Api) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if api("GET", "/dags", params={"dag_id_pattern": DAG_ID})["total_entries"]:
            return
        time.sleep(1)
    raise AssertionError(f"{DAG_ID} was not parsed; import errors: {api('GET', '/importErrors')}")


def test_compose_runs_the_demo_and_leaves_nothing(images: dict[str, str], tmp_path: Path) -> None:
    project = f"flare-test-{secrets.token_hex(4)}"
    port = free_port()
    secrets_dir = tmp_path / "secrets"
    subprocess.run([str(ROOT / "docker" / "secrets.sh"), str(secrets_dir)], check=True, capture_output=True)
    env = {
        **os.environ,
        "FLARE_AIRFLOW_IMAGE": images["airflow"],
        "POSTGRES_IMAGE": images["postgres"],
        "FLARE_SECRETS_DIR": str(secrets_dir),
        "AIRFLOW_PORT": str(port),
    }
    compose = Compose(project, env)
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        up = compose("up", "-d", timeout=UP_TIMEOUT)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        _wait_for_api(base, compose)
        password_file = "/opt/airflow/simple_auth_manager_passwords.json.generated"
        passwords = compose("exec", "-T", "api-server", "cat", password_file, timeout=60)
        assert passwords.returncode == 0, passwords.stderr
        api = Api(base, json.loads(passwords.stdout)["admin"])
        up_seconds = time.monotonic() - started

        _wait_for_dag(api)
        api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
        run = api("POST", f"/dags/{DAG_ID}/dagRuns", json={"logical_date": None, "conf": {"rounds": ROUNDS}})
        run_id = run["dag_run_id"]
        deadline = time.monotonic() + RUN_TIMEOUT
        while (state := api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]) not in ("success", "failed"):
            assert time.monotonic() < deadline, f"run {run_id} not finished in {RUN_TIMEOUT} s (state {state})"
            time.sleep(2)
        body = api("GET", f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        tasks = {ti["task_id"]: ti["state"] for ti in body["task_instances"]}
        assert body["total_entries"] == len(tasks)
        sites = ("site-1", "site-2", "site-3", "site-4", "global_model")
        expected = {"prepare": "success", "publish": "success", "verdict": "success"}
        for r in range(1, 6):
            expected |= {f"round_{r}.{s}": "success" if r <= ROUNDS else "skipped" for s in sites}
        assert state == "success", tasks
        assert tasks == expected
        # The secrets were files: no container's configuration holds them.
        inspected = subprocess.run(
            [engine(), "inspect", *(f"{project}_{s}_1" for s in ("postgres", "api-server", "scheduler"))],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        for name in ("postgres_password", "jwt_secret"):
            assert (secrets_dir / name).read_text() not in inspected
        run_seconds = time.monotonic() - started - up_seconds
        print(f"compose: up {up_seconds:.0f} s, {ROUNDS}-round demo run {run_seconds:.0f} s")
    finally:
        down_started = time.monotonic()
        down = compose("down", "-v", "-t", "10", timeout=180)
        print(f"compose: down {time.monotonic() - down_started:.0f} s")
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    assert compose.leftovers() == {"containers": [], "networks": [], "volumes": [], "pods": []}
    with httpx.Client() as client:
        try:
            client.get(f"{base}/api/v2/monitor/health", timeout=2)
            raise AssertionError(f"{base} still answers after down")
        except httpx.ConnectError:
            pass
