"""NVFlare-native mode against a real FLARE deployment: NVFlare 2.9's POC system (a server and two
clients as separate processes, flare_airflow_testing/nvflare_poc.py), started once for this module.

* a DAG with one :class:`FlareJobOperator` runs NVFlare's own hello-numpy export through
  ``flare-airflow run`` (Airflow's ``dags test``, the trigger run inline): the task succeeds, the
  global model lands in the store as safetensors equal to what the job computes, the Asset event
  names the FLARE job;
* a retried submit (the same task of the same run, try 2) returns the same FLARE job, and FLARE
  holds exactly one job of that name;
* killing the deferred task (the triggerer's cancel + ``on_kill``) aborts a running FLARE job
  within 30 s; the aborted job then fails a trigger with its status and its logs' tail;
* a startup kit FLARE did not issue, and a connection without a kit, give clear errors;
* after the module, ``nvflare poc stop`` leaves no FLARE process (asserted in the fixture).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from flare_airflow.nvflare_native.admin import BRIDGE, FlareAdmin
from flare_airflow.nvflare_native.errors import FlareCredentialError
from flare_airflow.operators.nvflare_native import FlareJobOperator
from flare_airflow.triggers.flare_job import FlareJobTrigger
from flare_airflow_testing.harness import AirflowHome
from flare_airflow_testing.nvflare_poc import Poc, pids_mentioning
from flare_airflow_testing.side_venvs import SideVenv

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parents[1] / "integration" / "nvflare"
CONN = "flare_poc"
INITIAL = np.arange(1, 10, dtype=np.float32).reshape(3, 3)
ROUNDS = 2
STEP_PER_ROUND = (1 * 1 + 3 * 3) / 4  # hello_numpy_client.py: site-1 adds 1 (weight 1), site-2 adds 3 (weight 3)


DOC = Path(__file__).resolve().parents[2] / "docs" / "coming-from-nvflare.md"


def conn_json(side: SideVenv, kit: Path) -> str:
    """docs/coming-from-nvflare.md's connection line, its paths replaced by the POC's kit and NVFlare's python."""
    line = next(x for x in DOC.read_text().splitlines() if x.startswith("export AIRFLOW_CONN_FLARE_ADMIN_DEFAULT="))
    conn = json.loads(line.split("=", 1)[1].strip("'"))
    conn["extra"].update(startup_kit=str(kit), python=str(side.python))
    return json.dumps(conn)


def documented_dag(job_folder: str) -> str:
    """docs/coming-from-nvflare.md's native-mode DAG, as written, with the POC's job folder and connection."""
    text = DOC.read_text().split("## Native mode", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert '"jobs/hello-numpy"' in code and '"flare_admin_default"' in code
    return code.replace('"jobs/hello-numpy"', repr(job_folder)).replace('"flare_admin_default"', repr(CONN))


@pytest.fixture(scope="module")
def poc(nvflare_side: SideVenv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("flare-poc")
    jobs = root / "jobs"
    # The jobs are exported while the POC system is provisioned and started: neither reads the other.
    made = subprocess.Popen(
        [str(nvflare_side.python), str(HERE / "make_native_jobs.py"), str(jobs), str(HERE / "hello_numpy_client.py")],
        env=nvflare_side.env(),
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    system = Poc(nvflare_side, root, n=2)
    try:
        system.prepare()
        system.start()
    finally:
        try:
            made_out, made_err = made.communicate(timeout=300)
        finally:
            if made.poll() is None:
                made.kill()
                made.wait()
    try:
        assert made.returncode == 0, made_err[-3000:]
        folders = json.loads(made_out.strip().splitlines()[-1].removeprefix("RESULT "))
        yield {"poc": system, "jobs": folders, "conn": conn_json(nvflare_side, system.admin_kit), "root": root}
    finally:
        leftovers = system.stop()
        assert leftovers == [], f"`nvflare poc stop` left FLARE processes (killed by id): {leftovers}"
        assert system.running() == []


def flare_jobs(poc: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """FLARE's own list of jobs named ``name`` (NVFlare's Session API, in its environment)."""
    system: Poc = poc["poc"]
    code = (
        "import json, sys\n"
        "from nvflare.fuel.flare_api.flare_api import new_secure_session\n"
        "s = new_secure_session('admin@nvidia.com', sys.argv[1])\n"
        "print('JOBS ' + json.dumps(s.list_jobs(name_prefix=sys.argv[2]), default=str))\n"
        "s.close()\n"
    )
    out = subprocess.run(
        [str(system.side.python), "-c", code, str(system.admin_kit), name],
        env=system.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("JOBS "))
    return [j for j in json.loads(line.removeprefix("JOBS ")) if j["job_name"] == name]


def task_context(dag_id: str, run_id: str, task_id: str, try_number: int) -> Any:
    return {
        "ti": SimpleNamespace(dag_id=dag_id, task_id=task_id, map_index=-1, try_number=try_number),
        "run_id": run_id,
    }


def test_completes_publishes_and_a_retry_finds_the_same_job(
    poc: dict[str, Any], airflow_home: AirflowHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = airflow_home.dags / "native"
    folder.mkdir()
    dag_file = folder / "native_dag.py"
    dag_file.write_text(documented_dag(poc["jobs"]["hello-numpy"]))
    env = {f"AIRFLOW_CONN_{CONN.upper()}": poc["conn"]}
    result = airflow_home.run("flare_native_hello", dag_file, env=env)
    assert result.tasks == {"publish": "success"}, result.log[-4000:]
    assert result.returncode == 0

    pointer = json.loads((airflow_home.store / "hello-numpy" / "latest.json").read_text())
    assert pointer["run_id"] == result.state["run_id"]
    final = load_file(pointer["model_uri"].removeprefix("file://"))
    np.testing.assert_array_equal(final["numpy_key"], INITIAL + ROUNDS * STEP_PER_ROUND)
    job_id = pointer["flare_job_id"]
    jobs = flare_jobs(poc, "hello-numpy")
    assert [(j["job_id"], j["status"]) for j in jobs] == [(job_id, "FINISHED:COMPLETED")]

    # The Asset a native run of this job would update, with the FLARE job in its event.
    with sqlite3.connect(airflow_home.home / "airflow.db") as db:
        events = db.execute(
            "SELECT a.name, e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id WHERE a.name = ?",
            ("flare_airflow.hello-numpy.global_model",),
        ).fetchall()
    assert len(events) == 1 and json.loads(events[0][1])["flare_job_id"] == job_id

    # Try 2 of the same task in the same run: FLARE's submit token finds the completed job.
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", poc["conn"])
    retry = FlareJobOperator(task_id="publish", job_folder=poc["jobs"]["hello-numpy"], flare_conn_id=CONN)
    answer = retry.submit_job(task_context("flare_native_hello", result.state["run_id"], "publish", 2))
    assert answer["job_id"] == job_id and answer["adopted"] is True
    assert [j["job_id"] for j in flare_jobs(poc, "hello-numpy")] == [job_id]


def test_killing_the_deferred_task_aborts_the_flare_job(poc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", poc["conn"])
    op = FlareJobOperator(task_id="long", job_folder=poc["jobs"]["hello-long"], flare_conn_id=CONN)
    job_id = str(op.submit_job(task_context("flare_native_kill", "manual__kill", "long", 1))["job_id"])
    admin = op.admin()
    trigger = FlareJobTrigger(job_id=job_id, flare_conn_id=CONN, poll_interval=0.5)

    async def kill_while_running() -> float:
        watch = asyncio.ensure_future(trigger.run().__anext__())
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(admin.status, job_id) != "RUNNING":
            assert time.monotonic() < deadline and not watch.done(), "the FLARE job never started running"
            await asyncio.sleep(0.5)
        assert not watch.done()
        # What Airflow's triggerer does when a user kills the deferred task: cancel, then on_kill().
        watch.cancel()
        killed = time.monotonic()
        await trigger.on_kill()
        return killed

    killed = asyncio.run(kill_while_running())
    status = admin.status(job_id)  # abort_job returns once FLARE has aborted the job, as a rule
    while status != "FINISHED:ABORTED" and time.monotonic() - killed < 30:
        time.sleep(0.5)
        status = admin.status(job_id)
    assert status == "FINISHED:ABORTED", f"FLARE job {job_id} still {status} 30 s after the kill"
    assert pids_mentioning(str(BRIDGE)) == [], "the trigger's watcher outlived the kill"

    # The aborted job, followed again: a failed event with FLARE's status and its logs' tail.
    async def follow() -> dict[str, Any]:
        event = await FlareJobTrigger(job_id=job_id, flare_conn_id=CONN, log_lines=5).run().__anext__()
        return dict(event.payload)

    event = asyncio.run(follow())
    assert event["status"] == "failed" and event["native"] == "FINISHED:ABORTED" and event["return_code"] == 9
    assert f"FLARE job {job_id} ended FINISHED:ABORTED" in event["reason"]
    assert "--- server ---" in event["reason"] and 0 < len(event["logs"]["server"].splitlines()) <= 5


def test_a_startup_kit_flare_did_not_issue_is_refused_clearly(poc: dict[str, Any], nvflare_side: SideVenv) -> None:
    system: Poc = poc["poc"]
    # The admin kit with a certificate of the same name that this deployment's CA did not sign.
    forged = poc["root"] / "forged-kit"
    shutil.copytree(system.admin_kit, forged)
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=admin@nvidia.com/O=nvidia",
            "-keyout",
            str(forged / "startup" / "client.key"),
            "-out",
            str(forged / "startup" / "client.crt"),
        ],
        capture_output=True,
        check=True,
        timeout=60,
    )
    with pytest.raises(FlareCredentialError) as refused:
        FlareAdmin(python=str(nvflare_side.python), startup_kit=str(forged)).status("no-such-job")
    assert f"the FLARE server refused the admin startup kit {forged}" in str(refused.value)
    assert "InvalidCertChain" in str(refused.value)

    with pytest.raises(FlareCredentialError) as missing:
        FlareAdmin(python=str(nvflare_side.python), startup_kit=str(poc["root"] / "no-kit")).status("x")
    assert "is not a FLARE admin startup kit" in str(missing.value)
