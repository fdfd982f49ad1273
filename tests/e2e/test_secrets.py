"""Secrets of a process site through real Airflow: a canary set as an Airflow connection password and
an Airflow variable reaches the trainer's environment, and nowhere else -- no process argv while the
job runs, no XCom or rendered field (the metadata database), no task log, nothing in the store."""

from __future__ import annotations

import hashlib
import pathlib
import secrets
import threading
import time

import pytest

from flare_airflow_testing.harness import AirflowHome, tiny_model

pytestmark = pytest.mark.e2e

TRAINER = """
import hashlib, json, os, sys, time
import flare_airflow.client as flare

model = flare.receive()
if flare.is_evaluate():  # the server's evaluation of the global model: no site, no secrets
    flare.send(flare.FLModel(metrics={"ok": 1.0}))
    sys.exit(0)
token, key = os.environ["API_TOKEN"], os.environ["DB_KEY"]
# A careless trainer: prints its secrets. Airflow must mask them in the task log.
print(f"using token {token} and key {key}", flush=True)
with open(sys.argv[1] + "." + flare.get_site_name(), "w") as fh:
    json.dump({n: hashlib.sha256(v.encode()).hexdigest() for n, v in (("token", token), ("key", key))}, fh)
time.sleep(1.5)  # long enough for the argv scan to see this job's processes
flare.send(flare.FLModel(params={k: v + 1 for k, v in model.params.items()}, meta={"num_samples": 1}))
"""


def _scan_argv(needle: bytes, stop: threading.Event, seen: list[str], scanned: list[int]) -> None:
    while not stop.is_set():
        for proc in pathlib.Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            scanned.append(int(proc.name))
            if needle in cmdline:
                seen.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
        time.sleep(0.05)


def _files_holding(root: pathlib.Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_a_secret_canary_reaches_the_trainer_and_nothing_else(airflow_home: AirflowHome, tmp_path) -> None:
    token = "canary-token-" + secrets.token_hex(12)
    key = "canary-key-" + secrets.token_hex(12)
    script = tmp_path / "secret_trainer.py"
    script.write_text(TRAINER)
    proof = tmp_path / "proof"
    launcher_spec = {
        "process": {
            "secret_env": {
                "API_TOKEN": {"conn_id": "flare_canary", "field": "password"},
                "DB_KEY": {"variable": "flare_canary_key"},
            }
        }
    }
    job = {
        "job": "secrets",
        "rounds": 1,
        "min_clients": 2,
        "initial_model": str(tiny_model(airflow_home.root / "secrets-init.safetensors")),
        "trainer": {"script": str(script), "args": [str(proof)], "shutdown_timeout": 2},
        "sites": {
            "@default": {"retries": 0, "launcher_spec": launcher_spec},
            "site-1": {},
            "site-2": {},
        },
    }
    dag_file = airflow_home.write_job("secrets", job)
    assert token.encode() not in dag_file.with_name("job.yaml").read_bytes()
    saved = dict(airflow_home.env)
    airflow_home.env["AIRFLOW_CONN_FLARE_CANARY"] = (
        f'{{"conn_type": "generic", "login": "flare", "password": "{token}"}}'
    )
    airflow_home.env["AIRFLOW_VAR_FLARE_CANARY_KEY"] = key
    stop = threading.Event()
    seen: dict[str, list[str]] = {"token": [], "key": []}
    scanned: list[int] = []
    scanners = [
        threading.Thread(target=_scan_argv, args=(value.encode(), stop, seen[name], scanned), daemon=True)
        for name, value in (("token", token), ("key", key))
    ]
    for scanner in scanners:
        scanner.start()
    try:
        # The trainer writes its proof outside its staging directory: the site admin allows it
        # (the site policy's launcher_spec replaces the job's, so it names the secrets too).
        policy = {
            "sites": {
                s: {"launcher_spec": launcher_spec, "confinement": {"writable": [str(tmp_path)]}}
                for s in ("site-1", "site-2")
            }
        }
        result = airflow_home.run("flare_secrets", dag_file, site_policy=policy)
    finally:
        stop.set()
        for scanner in scanners:
            scanner.join(timeout=10)
        airflow_home.env.clear()
        airflow_home.env.update(saved)

    assert result.tasks["round_1.site-1"] == "success", result.log[-4000:]
    assert result.tasks["round_1.site-2"] == "success", result.log[-4000:]
    assert result.tasks["publish"] == "success"
    # The trainers got both secrets (proof written outside the store, as hashes only).
    for site in ("site-1", "site-2"):
        got = (proof.parent / f"proof.{site}").read_text()
        assert hashlib.sha256(token.encode()).hexdigest() in got
        assert hashlib.sha256(key.encode()).hexdigest() in got
    assert scanned, "the argv scan never ran"
    assert seen == {"token": [], "key": []}, f"a secret appeared in a process's argv: {seen}"
    # The trainer printed its secrets: the site runner replaces them with *** in every line it
    # relays (Airflow's own masker does not reach the console of `airflow dags test`).
    assert "***" in result.log
    for value in (token, key):
        # The metadata database (XCom, rendered fields, task instances), task log files, this run's
        # log, the model store and the dags folder: nothing of the Airflow home holds the value.
        holders = _files_holding(airflow_home.root, value.encode())
        assert holders == [], holders


def test_an_unresolvable_secret_reference_names_site_variable_and_connection(airflow_home: AirflowHome) -> None:
    job = {
        "job": "no-secret",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": str(tiny_model(airflow_home.root / "no-secret-init.safetensors")),
        "trainer": {"script": str(pathlib.Path(__file__).parent / "trainers" / "behave.py"), "shutdown_timeout": 2},
        "sites": {
            "@default": {"retries": 0},
            "site-1": {},
            "site-2": {"launcher_spec": {"process": {"secret_env": {"API_TOKEN": {"conn_id": "flare_missing_conn"}}}}},
        },
    }
    result = airflow_home.run("flare_no_secret", airflow_home.write_job("no_secret", job))
    assert result.tasks["round_1.site-2"] == "failed"
    assert result.tasks["round_1.site-1"] == "success"
    assert (
        "site 'site-2': secret_env API_TOKEN could not be resolved from connection 'flare_missing_conn' password"
        in result.log
    )
    assert "AIRFLOW_CONN_FLARE_MISSING_CONN" in result.log
