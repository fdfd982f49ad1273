"""Sites at the sites: the demo job's 4 sites on 4 Airflow Edge workers, models through S3.

Real components: api-server, scheduler (LocalExecutor + EdgeExecutor), dag-processor and triggerer
on PostgreSQL; one ``airflow edge worker --queues site-N`` per site, each with its own Airflow
home, DAGs copy, site policy and store credentials and no database; one site (``CONTAINER_SITE``)
runs its jobs as containers of the trainer image under rootful podman on its worker; moto's S3 server (an emulator,
see flare_airflow_testing/s3_server.py) with signatures enforced. The central side runs in a network namespace,
each worker in one of its own that reaches only the central side's API and S3 ports
(flare_airflow_testing/netns.py). Follows docs/deploy-across-sites.md.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from flare_airflow_testing.containers import CreatedContainers, containers_left
from flare_airflow_testing.edge_sites import EdgeDeployment
from flare_airflow_testing.harness import AirflowHome

pytestmark = pytest.mark.e2e

SITES = ["site-1", "site-2", "site-3", "site-4"]
DAG = "flare_digits"
# Two rounds prove what more would: round 2 trains on the global model round 1's sites made (each
# round costs ~25 s of the tier).
ROUNDS = 2
# A container site (the guide's 'Container sites at a site'); the other sites run processes.
CONTAINER_SITE = "site-2"
JOB_LABEL = "flare-airflow.job=digits"  # every container of the demo job carries it
CENTRAL_TASKS = {"prepare", "publish", "verdict"} | {f"round_{r}.global_model" for r in range(1, ROUNDS + 1)}


# A site task (site-1's queue, its Edge worker) and a central task that each try to resolve the
# central store connection and a central Variable through the Execution API.
PROBE_DAG = "flare_site_probe"
PROBE_SOURCE = f"""
from airflow.sdk import dag, task

CENTRAL = (("connection", "flare_store"), ("variable", "flare_central_noise_secret"))


def _resolve():
    from airflow.sdk import Connection, Variable

    out = {{}}
    for kind, name in CENTRAL:
        try:
            (Connection.get if kind == "connection" else Variable.get)(name)
            out[name] = "resolved"
        except Exception as exc:
            out[name] = f"{{type(exc).__name__}}: {{exc}}"
    return out


@dag(dag_id="{PROBE_DAG}", schedule=None, catchup=False)
def probe():
    task(queue="site-1", executor="EdgeExecutor", task_id="at_site_1")(_resolve)()
    task(task_id="central")(_resolve)()


probe()
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, trainer_image: str) -> Any:
    dep = EdgeDeployment(
        tmp_path_factory.mktemp("edge"),
        SITES,
        rounds=ROUNDS,
        isolated=True,
        container_sites={CONTAINER_SITE: trainer_image},
        extra_dags={"site_probe_dag.py": PROBE_SOURCE},
    )
    try:
        dep.start()
        yield dep
    finally:
        dep.stop()


@pytest.fixture(scope="module")
def one_machine_sha256(airflow_home: AirflowHome) -> Iterator[Future[str]]:
    """The final model of the same job, rounds and seed on one machine (local store, no queues).

    A future: the run (a process of its own) goes on while the deployment starts, so a test asks
    for this fixture before ``deployment``."""
    folder = airflow_home.copy_repo_dags("edge_reference")
    # A DAG id of its own: the session's Airflow home also holds the demo test's flare_digits.
    dag_file = folder / "digits_dag.py"
    dag_file.write_text(
        "from pathlib import Path\nfrom flare_airflow.builder import build_dag\n"
        "dag = build_dag(Path(__file__).with_name('digits.yaml'), dag_id='flare_digits_one_machine')\n"
    )

    def run() -> str:
        result = airflow_home.run("flare_digits_one_machine", dag_file, conf={"rounds": ROUNDS})
        assert result.returncode == 0 and result.state["state"] == "success", result.log[-3000:]
        return str(result.state["published"]["sha256"])

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run)


def _run(
    dep: EdgeDeployment, conf: dict[str, Any] | None = None, timeout: float = 240, *, dag: str = DAG
) -> tuple[str, dict]:
    run_id = dep.stack.trigger(dag, conf)
    dep.stack.wait_for_run(dag, run_id, timeout=timeout)
    return run_id, dep.stack.task_instances(dag, run_id)


def _xcom(dep: EdgeDeployment, run_id: str, task_id: str, key: str, *, dag: str = DAG) -> Any:
    from urllib.parse import quote

    path = f"/dags/{dag}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/xcomEntries/{key}"
    return dep.stack.api("GET", path)["value"]


def test_every_site_runs_on_its_own_worker_and_the_model_matches_one_machine(
    one_machine_sha256: Future[str], deployment: EdgeDeployment
) -> None:
    with CreatedContainers(JOB_LABEL) as containers:
        run_id, tis = _run(deployment)
    # The container site's sweep runs on its own worker, where its engine is.
    sweep = f"sweep_containers_{deployment.workers[CONTAINER_SITE].queue}"
    assert {t: ti["state"] for t, ti in tis.items()} == dict.fromkeys(
        CENTRAL_TASKS | {sweep} | {f"round_{r}.{s}" for r in range(1, ROUNDS + 1) for s in SITES}, "success"
    )
    workers = {w.name for w in deployment.workers.values()}
    for task_id, ti in tis.items():
        if task_id in CENTRAL_TASKS:
            # The central side runs the aggregation; never on a site's worker.
            assert ti["hostname"] not in workers and ti["queue"] == "default", ti
        else:
            site = CONTAINER_SITE if task_id == sweep else task_id.split(".", 1)[1]
            assert (ti["hostname"], ti["queue"], ti["executor"]) == (
                f"{site}-worker",
                deployment.workers[site].queue,
                "EdgeExecutor",
            ), ti
    published = _xcom(deployment, run_id, "publish", "return_value")
    # The container site's rounds too: its image's trainer computes what a process trainer does.
    assert published["sha256"] == one_machine_sha256.result(timeout=600), (
        "the edge run's final model differs from the one-machine run"
    )
    _assert_container_site_saw_only_its_staged_files(containers.created, run_id)
    assert containers_left(JOB_LABEL) == [], "every container of the job is removed when its task ends"
    assert published["final_model"].startswith("s3://")
    # Every accepted update is in the store with its record; nothing was staged in the bucket.
    keys = deployment.s3.keys("store/digits/")
    for r in range(1, ROUNDS + 1):
        for site in SITES:
            assert any(k.endswith(f"round-{r:04d}/sites/{site}.safetensors") for k in keys), (r, site)
            assert any(k.endswith(f"round-{r:04d}/sites/{site}.json") for k in keys), (r, site)
    assert not [k for k in keys if "/staging/" in k]
    # Each site trained on its own data file (its policy points the trainer there; a missing file
    # would fail its tasks), which exists only in its worker's mount namespace: outside, its
    # directory is the empty one on the host, and a new process -- even one in the site's network
    # namespace -- cannot open it.
    assert deployment.ns is not None
    for site, worker in deployment.workers.items():
        data = worker.data / f"{site}.npz"
        assert list(worker.data.iterdir()) == [], site
        assert worker.proc is not None
        assert pathlib.Path(f"/proc/{worker.proc.pid}/root{data}").is_file(), site  # the worker's own view
        assert not _reaches_file(deployment.ns.site_ns[site], data), site


def _states(tis: dict[str, Any]) -> dict[str, str]:
    return {t: ti["state"] for t, ti in tis.items()}


def _expected(sweep: str, rounds: int, **states: str) -> dict[str, str]:
    """Every task instance of a ``rounds``-round run of the job's DAG: success, the rounds after
    ``rounds`` skipped, unless ``states`` (task id -> state) says otherwise."""
    out = dict.fromkeys({"prepare", "publish", "verdict", sweep}, "success")
    for r in range(1, ROUNDS + 1):
        out.update(
            dict.fromkeys([f"round_{r}.{s}" for s in [*SITES, "global_model"]], "success" if r <= rounds else "skipped")
        )
    return {**out, **states}


def test_sites_with_a_wrong_or_no_store_credential_train_through_their_links(deployment: EdgeDeployment) -> None:
    """Sites need no store credential: each round's global model and the site's own slot come as
    links the central side minted and sealed to the site's box key (docs/model-store.md). One run,
    two sites: site-3's worker holds a wrong secret, site-4's defines no store connection at all."""
    starts: dict[str, dict[str, Any]] = {"site-3": {"secret": "not-the-secret"}, "site-4": {"connection": False}}
    deployment.restart_workers(starts)
    try:
        run_id, tis = _run(deployment, {"rounds": 1})
    finally:
        deployment.restart_workers({site: {} for site in starts})
    sweep = f"sweep_containers_{deployment.workers[CONTAINER_SITE].queue}"
    failures = {
        s: _xcom(deployment, run_id, f"round_1.{s}", "failure")
        for s in starts
        if tis[f"round_1.{s}"]["state"] != "success"
    }
    assert _states(tis) == _expected(sweep, rounds=1), failures
    assert {s: tis[f"round_1.{s}"]["hostname"] for s in starts} == {s: f"{s}-worker" for s in starts}
    assert _xcom(deployment, run_id, "round_1.global_model", "return_value")["accepted"] == SITES


def test_a_worker_stopped_mid_round_the_round_completes_within_quorum_and_its_next_round_runs_there(
    deployment: EdgeDeployment,
) -> None:
    worker = deployment.workers["site-3"]
    run_id = deployment.stack.trigger(DAG, {"rounds": 2})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = deployment.stack.task_instances(DAG, run_id).get("round_1.site-3", {}).get("state")
        if state == "running":
            break
        assert state in (None, "scheduled", "queued"), state
        time.sleep(0.2)
    else:
        pytest.fail("round_1.site-3 never started")
    worker.kill()  # mid-round: its task process goes with it
    while deployment.stack.task_instances(DAG, run_id)["round_1.global_model"]["state"] != "success":
        assert time.monotonic() < deadline + 120, "round 1 did not complete without site-3"
        time.sleep(1)
    worker.start()
    deployment.stack.wait_for_run(DAG, run_id, timeout=180)
    tis = deployment.stack.task_instances(DAG, run_id)
    sweep = f"sweep_containers_{deployment.workers[CONTAINER_SITE].queue}"
    assert _states(tis) == _expected(sweep, rounds=2, **{"round_1.site-3": "failed"})
    assert tis["round_1.site-3"]["state"] == "failed"
    assert _xcom(deployment, run_id, "round_1.global_model", "return_value")["accepted"] == [
        "site-1",
        "site-2",
        "site-4",
    ]
    assert (tis["round_2.site-3"]["state"], tis["round_2.site-3"]["hostname"]) == ("success", "site-3-worker")
    assert all(tis[t]["state"] == "success" for t in ("round_2.global_model", "publish")), tis
    assert {ti["hostname"] for t, ti in tis.items() if t.endswith("site-3")} <= {"site-3-worker", None, ""}


def _assert_container_site_saw_only_its_staged_files(created: list[dict[str, Any]], run_id: str) -> None:
    """One container per round, all of the container site, each mounting exactly the round's global
    model and its record (read-only) and the try's staging directory (read-write) -- the local
    copies its site task staged from S3 on the worker, at the paths the Client API's variables
    name -- and nothing else of the worker or the store."""
    assert all("error" not in c for c in created), created
    ours = [c for c in created if c["labels"].get("flare-airflow.run-id") == run_id]
    assert sorted((c["labels"]["flare-airflow.site"], int(c["labels"]["flare-airflow.round"])) for c in ours) == [
        (CONTAINER_SITE, r) for r in range(1, ROUNDS + 1)
    ], created
    for c in ours:
        binds = c["mounts"]
        assert all(src == dst for src, dst, _ in binds), binds
        written = [src for src, _, read_only in binds if not read_only]
        round_num = c["labels"]["flare-airflow.round"]
        pattern = rf"(/.+/flare-{CONTAINER_SITE}-r{round_num}-[^/]+)/staging/{CONTAINER_SITE}/try-1"
        staged = re.fullmatch(pattern, written[0]) if len(written) == 1 else None
        assert staged, binds
        read = sorted(src for src, _, read_only in binds if read_only)
        assert read == [f"{staged[1]}/global/global.json", f"{staged[1]}/global/global.safetensors"], binds


def _reaches(ns: str, host: str, port: int) -> bool:
    """Whether a TCP connection from network namespace ``ns`` to ``host:port`` succeeds."""
    code = f"import socket; socket.create_connection(({host!r}, {port}), timeout=2).close()"
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, check=False)
    return out.returncode == 0


def _reaches_file(ns: str, path: pathlib.Path) -> bool:
    """Whether a process that ``ip netns exec`` starts in ``ns`` can open ``path``.

    Only the worker's own mount namespace holds its tmpfs: a new process in the same network
    namespace gets a new mount namespace too, so it must not see the file either.
    """
    code = f"open({str(path)!r}, 'rb').close()"
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, check=False)
    return out.returncode == 0


def test_each_site_reaches_only_the_central_api_and_store(deployment: EdgeDeployment) -> None:
    ns = deployment.ns
    assert ns is not None
    site1, site2 = ns.site_ns["site-1"], ns.site_ns["site-2"]
    central = ns.site_peer["site-1"]
    assert _reaches(site1, central, deployment.stack.port)  # the API server
    assert _reaches(site1, central, deployment.s3.port)  # the S3 endpoint
    assert not _reaches(site1, ns.site_addr["site-2"], 22)  # another site: no route
    assert not _reaches(site1, ns.central_addr, deployment.stack.port)  # the central side's other link
    assert not _reaches(site1, ns.site_peer["site-2"], deployment.stack.port)
    assert not _reaches(site2, "127.0.0.1", deployment.stack.port)  # its own loopback: nothing central
    # The root namespace (this test process) reaches only the central side's address.
    assert not _reaches(site1, ns.central_addr.rsplit(".", 1)[0] + ".1", 22)


def _as_site(
    dep: EdgeDeployment, site: str, verb: str, method: str, body: Any = None, *, worker: str | None = None
) -> Any:
    """A worker API call signed with ``site``'s own key (what its worker holds), as ``worker``."""
    import httpx

    from flare_airflow.core.trust.tokens import sign_worker_token

    kid, key = dep.site_key(site)
    token = sign_worker_token(key, kid, site=site, worker=worker or f"{site}-worker", method=method)
    return httpx.request(
        verb, f"{dep.stack.base}/edge_worker/v1/{method}", json=body, headers={"Authorization": token}, timeout=30
    )


def _refused(response: Any, reason: str) -> None:
    assert response.status_code == 403, (response.status_code, response.text)
    assert reason in response.json()["detail"], response.json()


def test_a_site_acting_beyond_its_grant_is_refused_and_the_federation_finishes(deployment: EdgeDeployment) -> None:
    """Site-2, with everything its worker holds, tries to take site-1's work, act under its worker's
    name, fail site-1's running job, forge its log and mint REST and Execution tokens."""
    import httpx
    import jwt

    site1_queue = deployment.workers["site-1"].queue
    run_id = deployment.stack.trigger(DAG, {"rounds": 1})
    deadline = time.monotonic() + 180
    while (ti := deployment.stack.task_instances(DAG, run_id).get("round_1.site-1", {})).get("state") != "running":
        assert time.monotonic() < deadline and ti.get("state") in (None, "scheduled", "queued"), ti
        time.sleep(0.2)
    fetch = {"queues": [site1_queue], "free_concurrency": 1}
    _refused(
        _as_site(deployment, "site-2", "POST", "jobs/fetch/site-2-worker", fetch),
        f"site 'site-2' may not fetch jobs of queue(s) ['{site1_queue}']",
    )
    _refused(
        _as_site(deployment, "site-2", "POST", "jobs/fetch/site-2-worker", {"queues": None, "free_concurrency": 1}),
        "site 'site-2' must name its queues to fetch jobs of",
    )
    state = {"state": "idle", "jobs_active": 0, "queues": [site1_queue], "sysinfo": {}}
    for as_worker in ("site-1-worker", "site-2-worker"):  # its token under site-1's worker's name
        _refused(
            _as_site(deployment, "site-2", "PATCH", "worker/site-1-worker", state, worker=as_worker),
            "may not act as worker 'site-1-worker': site 'site-1''s worker",
        )
    job = f"{DAG}/round_1.site-1/{run_id}/{ti['try_number']}/-1"
    _refused(
        _as_site(deployment, "site-2", "PATCH", f"jobs/state/{job}/failed"),
        "worker 'site-1-worker' took it",
    )
    log = {"log_chunk_time": "2026-12-06T00:00:00Z", "log_chunk_data": "forged by site-2"}
    _refused(_as_site(deployment, "site-2", "POST", f"logs/push/{job}", log), "worker 'site-1-worker' took it")
    # A REST or Execution token forged with the site's key (nothing else it holds signs anything).
    kid, key = deployment.site_key("site-2")
    now = int(time.time())
    claims = {"sub": "admin", "aud": "apache-airflow", "iat": now, "nbf": now, "exp": now + 300, "role": "admin"}
    xcom = f"/execution/xcoms/{DAG}/{run_id}/round_1.site-1/return_value"
    for path, sub in (("/api/v2/variables", "admin"), (xcom, ti["id"])):
        forged = jwt.encode({**claims, "sub": sub}, key, algorithm="EdDSA", headers={"kid": kid})
        r = httpx.get(f"{deployment.stack.base}{path}", headers={"Authorization": f"Bearer {forged}"}, timeout=30)
        assert r.status_code in (401, 403), (path, r.status_code, r.text)
    deployment.stack.wait_for_run(DAG, run_id, timeout=240)
    tis = deployment.stack.task_instances(DAG, run_id)
    assert _states(tis) == _expected(f"sweep_containers_{deployment.workers[CONTAINER_SITE].queue}", rounds=1)
    assert {s: (tis[f"round_1.{s}"]["state"], tis[f"round_1.{s}"]["hostname"]) for s in SITES} == {
        s: ("success", f"{s}-worker") for s in SITES
    }
    assert _xcom(deployment, run_id, "round_1.global_model", "return_value")["accepted"] == SITES
    assert tis["publish"]["state"] == "success"
    logs = (deployment.stack.root / "api-server.log").read_text()
    assert "flare-airflow refused PATCH /edge_worker/v1/jobs/state/" in logs


def test_a_site_task_cannot_resolve_central_secrets_a_central_task_can(deployment: EdgeDeployment) -> None:
    secret = "5e" * 32
    deployment.stack.api("POST", "/variables", json={"key": "flare_central_noise_secret", "value": secret})
    try:
        run_id, tis = _run(deployment, dag=PROBE_DAG)
    finally:
        deployment.stack.api("DELETE", "/variables/flare_central_noise_secret")
    assert {t: (ti["state"], ti["hostname"] == "site-1-worker") for t, ti in tis.items()} == {
        "at_site_1": ("success", True),
        "central": ("success", False),
    }
    at_site = _xcom(deployment, run_id, "at_site_1", "return_value", dag=PROBE_DAG)
    assert all(v.startswith("AirflowSecretsBackendAccessDenied: Access denied") for v in at_site.values()), at_site
    assert _xcom(deployment, run_id, "central", "return_value", dag=PROBE_DAG) == dict.fromkeys(at_site, "resolved")
    logs = (deployment.stack.root / "api-server.log").read_text()
    for kind, name in (("variable", "flare_central_noise_secret"), ("connection", "flare_store")):
        assert f"a task of site 'site-1' may not resolve the central {kind} '{name}'" in logs


# What site-2 sends to the S3 endpoint from its own network namespace, with what its worker holds:
# no store credential, a made-up one, and its own presigned links edited to name other keys.
_STORE_PROBE = r"""
import json, sys
import boto3, httpx
from botocore.config import Config

spec = json.loads(sys.argv[1])
out = {}
for name, (verb, url) in spec["raw"].items():
    r = httpx.request(verb, url, content=b"forged by site-2" if verb == "PUT" else None, timeout=60)
    # An S3 error code, or the status's own phrase when the store answers with no body.
    out[name] = [r.status_code, r.text.partition("<Code>")[2].partition("</Code>")[0] or r.reason_phrase]
made_up = boto3.client(
    "s3", endpoint_url=spec["endpoint"], region_name="us-east-1", aws_access_key_id="AKIAMADEUPBYSITE2000",
    aws_secret_access_key="made-up-by-site-2", config=Config(signature_version="s3v4", retries={"max_attempts": 1}),
)
for name, (op, kw) in spec["made_up"].items():
    try:
        getattr(made_up, op)(Bucket=spec["bucket"], **kw)
        out[name] = [200, ""]
    except Exception as exc:
        resp = getattr(exc, "response", {})
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        out[name] = [status, resp.get("Error", {}).get("Code", repr(exc))]
print(json.dumps(out))
"""


def _from_site(dep: EdgeDeployment, site: str, spec: dict[str, Any]) -> dict[str, list[Any]]:
    """Run :data:`_STORE_PROBE` in ``site``'s network namespace with no AWS configuration at all."""
    import json

    assert dep.ns is not None
    env = {"PATH": "/usr/bin:/bin", "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    out = subprocess.run(
        ["ip", "netns", "exec", dep.ns.site_ns[site], sys.executable, "-c", _STORE_PROBE, json.dumps(spec)],
        capture_output=True, check=False, env=env, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return dict(json.loads(out.stdout))


def _maintenance(dep: EdgeDeployment, site: str, on: bool) -> None:
    """The central operator holds ``site``'s worker (it finishes what it runs and fetches nothing new:
    edge3's maintenance mode), or lets it go on; returns once the worker says so."""
    import httpx

    name = dep.workers[site].name
    url = f"{dep.stack.base}/edge_worker/ui/worker/{name}/maintenance"
    auth = {"Authorization": f"Bearer {dep.stack._token}"}
    if on:
        r = httpx.post(url, json={"maintenance_comment": "held by the attack test"}, headers=auth, timeout=60)
    else:
        r = httpx.delete(url, headers=auth, timeout=60)
    r.raise_for_status()
    deadline = time.monotonic() + 120
    while True:
        state = next(w.get("state") for w in dep.edge_workers() if w["worker_name"] == name)
        if (state == "maintenance mode") if on else (state in ("idle", "running")):
            return
        assert time.monotonic() < deadline, (name, state)
        time.sleep(0.5)


def _wait_states(dep: EdgeDeployment, run_id: str, want: dict[str, str], timeout: float = 240) -> dict[str, Any]:
    """Until each task of ``want`` is in its state (``a|b``: either)."""
    deadline = time.monotonic() + timeout
    while True:
        tis = dep.stack.task_instances(DAG, run_id)
        if all(tis.get(t, {}).get("state") in s.split("|") for t, s in want.items()):
            return tis
        assert time.monotonic() < deadline, {t: tis.get(t, {}).get("state") for t in want}
        time.sleep(0.5)


def _set_xcom(dep: EdgeDeployment, run_id: str, task_id: str, value: Any) -> None:
    from urllib.parse import quote

    path = f"/dags/{DAG}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/xcomEntries/return_value"
    dep.stack.api("PATCH", path, json={"value": value, "map_index": -1})


def test_a_malicious_site_attacks_the_data_plane_each_is_refused_and_the_run_publishes(
    deployment: EdgeDeployment,
) -> None:
    """Site-2, with exactly what its worker holds (its keys, its files, the ciphertext in XCom, its
    network namespace), attacks the store during a real 2-round run; an insider with the store's
    credential swaps an update and replaces a global model. Each is refused with its reason, the
    run finishes within quorum and publishes.

    Site-2's worker is held (edge3 maintenance mode) while the attacks run, so that they happen at
    a known point of the run: round 1 after the other sites trained, round 2 before site-2 trains."""
    import hashlib

    from flare_airflow.core.store_links import LinksError
    from flare_airflow.core.trust.sealed import SealedOpenError
    from flare_airflow.operators.links import LINKS_KEY, open_site_links

    s3, bucket = deployment.s3, "flare"
    site2 = deployment.workers["site-2"]
    site2_keys = str(site2.root / "keys")
    store_at_site2 = f"http://{site2.central}:{s3.port}"  # the store as site-2's namespace reaches it
    # A worker may not register or heartbeat for no queue: a well-formed call (edge3 alone takes a
    # heartbeat with no queues; a second registration of an active worker it refuses as a duplicate).
    from airflow import __version__ as airflow_version
    from airflow.providers.edge3 import __version__ as edge_version

    sysinfo = {"airflow_version": airflow_version, "edge_provider_version": edge_version, "concurrency": 2}
    no_queue = {"state": "idle", "jobs_active": 0, "queues": [], "sysinfo": sysinfo}
    calls = {verb: _as_site(deployment, "site-2", verb, "worker/site-2-worker", no_queue) for verb in ("POST", "PATCH")}
    reason = "site 'site-2' must name its queues to register or heartbeat for"
    assert {v: (r.status_code, reason in r.text) for v, r in calls.items()} == {
        "POST": (403, True),
        "PATCH": (403, True),
    }, {v: r.text for v, r in calls.items()}

    _maintenance(deployment, "site-2", on=True)
    with CreatedContainers(JOB_LABEL) as containers:
        run_id = deployment.stack.trigger(DAG, {"rounds": 2})
        try:
            _wait_states(deployment, run_id, {f"round_1.{s}": "success" for s in ("site-1", "site-3", "site-4")})
            keys = {k.split("/round-", 1)[1]: k for k in s3.keys("store/digits/") if run_id_part(run_id) in k}
            site1_update, global_0 = keys["0001/sites/site-1.safetensors"], keys["0000/global.safetensors"]
            sealed = _xcom(deployment, run_id, "prepare", "return_value")[LINKS_KEY]

            # 1. Site-1's sealed links do not open with site-2's box key.
            with pytest.raises(SealedOpenError, match="not to this worker's box key"):
                open_site_links(
                    {LINKS_KEY: {"site-2": sealed["site-1"]}}, job="digits", run_id=run_id, round_num=1,
                    site="site-2", key_dir=site2_keys,
                )  # fmt: skip
            # 3. Its own round-1 links, replayed in round 2: they open only for round 1.
            with pytest.raises(SealedOpenError, match="another job, run, round or party"):
                open_site_links({LINKS_KEY: sealed}, job="digits", run_id=run_id, round_num=2, site="site-2",
                                key_dir=site2_keys)  # fmt: skip
            own = open_site_links({LINKS_KEY: sealed}, job="digits", run_id=run_id, round_num=1, site="site-2",
                                  key_dir=site2_keys)  # fmt: skip
            assert own is not None and own.update.url is not None
            with pytest.raises(LinksError, match="for round 1, not 2"):
                own.check(job="digits", run_id=run_id, round_num=2, site="site-2")
            other_run, put = own.global_model.replace(run_id_part(run_id), "another-run"), own.update.url
            before = {k: hashlib.sha256(_get(s3, k)).hexdigest() for k in (site1_update, global_0)}
            # 2. The store itself, from site-2's namespace: its own links edited to name other keys,
            # no credential, a made-up one.
            got = _from_site(
                deployment,
                "site-2",
                {
                    "endpoint": store_at_site2,
                    "bucket": bucket,
                    "raw": {
                        "own link: the global model": ("GET", own.global_model),
                        "own link -> site-1's slot": ("PUT", put.replace("/sites/site-2.", "/sites/site-1.")),
                        "own link -> another run's global": ("GET", other_run),
                        "last round's link -> this round's slot": ("PUT", put.replace("/round-0001/", "/round-0002/")),
                        "no credential: list": ("GET", f"{store_at_site2}/{bucket}?list-type=2&prefix=store/"),
                        "no credential: read site-1's update": ("GET", f"{store_at_site2}/{bucket}/{site1_update}"),
                        "no credential: write site-1's slot": ("PUT", f"{store_at_site2}/{bucket}/{site1_update}"),
                        "no credential: overwrite the global": ("PUT", f"{store_at_site2}/{bucket}/{global_0}"),
                    },
                    "made_up": {
                        "made-up key: list": ("list_objects_v2", {"Prefix": "store/"}),
                        "made-up key: read site-1's update": ("get_object", {"Key": site1_update}),
                        "made-up key: write site-1's slot": ("put_object", {"Key": site1_update, "Body": "x"}),
                        "made-up key: overwrite the global": ("put_object", {"Key": global_0, "Body": "x"}),
                    },
                },
            )
            assert got.pop("own link: the global model") == [200, "OK"]  # its genuine link works
            denied = {
                "own link -> site-1's slot": "SignatureDoesNotMatch",
                "own link -> another run's global": "SignatureDoesNotMatch",
                "last round's link -> this round's slot": "SignatureDoesNotMatch",
                "no credential: list": "AccessDenied",
                # moto refuses an unsigned request for an existing object by its ACL, before IAM.
                "no credential: read site-1's update": "FORBIDDEN",
                "no credential: write site-1's slot": "FORBIDDEN",
                "no credential: overwrite the global": "FORBIDDEN",
                "made-up key: list": "InvalidAccessKeyId",
                "made-up key: read site-1's update": "InvalidAccessKeyId",
                "made-up key: write site-1's slot": "InvalidAccessKeyId",
                "made-up key: overwrite the global": "InvalidAccessKeyId",
            }
            assert got == {k: [403, code] for k, code in denied.items()}, got
            # ... while the central side's own credential lists and reads (the run goes on with it too).
            assert before == {k: hashlib.sha256(_get(s3, k)).hexdigest() for k in (site1_update, global_0)}

            # 4. An insider with the store's credential swaps site-1's update (site-3's, a valid
            # model) and overwrites site-1's XCom digest to match: refused at the aggregation.
            site3_update = keys["0001/sites/site-3.safetensors"]
            for src, dst in ((site3_update, site1_update), (_record(site3_update), _record(site1_update))):
                s3.client().put_object(Bucket=bucket, Key=dst, Body=_get(s3, src))
            summary = _xcom(deployment, run_id, "round_1.site-1", "return_value")
            swapped = _xcom(deployment, run_id, "round_1.site-3", "return_value")["sha256"]
            _set_xcom(deployment, run_id, "round_1.site-1", {**summary, "sha256": swapped})

            # Round 2: site-2 is held again once it took its round-1 task.
            _maintenance(deployment, "site-2", on=False)
            _wait_states(deployment, run_id, {"round_1.site-2": "running|success"})
            _maintenance(deployment, "site-2", on=True)
            _wait_states(deployment, run_id, {f"round_2.{s}": "success" for s in ("site-1", "site-3", "site-4")})
            # 5. The round-1 global model replaced (tensors and record) after the others trained on
            # it: site-2 refuses it before its trainer starts. The DAG is paused meanwhile so that
            # the round's aggregation (which refuses it too) reads the genuine one, put back after.
            global_1 = keys["0000/global.safetensors"].replace("round-0000", "round-0001")
            genuine = {k: _get(s3, k) for k in (global_1, _record(global_1))}
            deployment.stack.api("PATCH", f"/dags/{DAG}", json={"is_paused": True})
            try:
                for src, dst in ((global_0, global_1), (_record(global_0), _record(global_1))):
                    s3.client().put_object(Bucket=bucket, Key=dst, Body=_get(s3, src))
                _maintenance(deployment, "site-2", on=False)
                _wait_states(deployment, run_id, {"round_2.site-2": "failed|success"})
                for k, body in genuine.items():
                    s3.client().put_object(Bucket=bucket, Key=k, Body=body)
            finally:
                deployment.stack.api("PATCH", f"/dags/{DAG}", json={"is_paused": False})
            deployment.stack.wait_for_run(DAG, run_id, timeout=240)
        finally:
            _maintenance(deployment, "site-2", on=False)
    tis = deployment.stack.task_instances(DAG, run_id)
    sweep = f"sweep_containers_{site2.queue}"
    expected = _expected(sweep, rounds=2, **{"round_2.site-2": "failed"})
    round_1 = _xcom(deployment, run_id, "round_1.global_model", "return_value")
    round_2 = _xcom(deployment, run_id, "round_2.global_model", "return_value")
    failure = (
        str(_xcom(deployment, run_id, "round_2.site-2", "failure"))
        if tis["round_2.site-2"]["state"] == "failed"
        else ""
    )
    ours = [c for c in containers.created if c["labels"].get("flare-airflow.run-id") == run_id]
    # One comparison, so that a defence taken away shows every assertion it breaks.
    assert {
        "states": {t: ti["state"] for t, ti in tis.items()},
        "round 1 counted": round_1["accepted"],
        "round 1 refused site-1, saying": "its signed record says sha256" in round_1["rejected"].get("site-1", ""),
        "round 2 counted": round_2["accepted"],
        "site-2 refused the replaced global, saying": "it was replaced" in failure,
        # Its trainer never started: site-2's containers in this run are its round 1's only.
        "site-2 containers, by round": sorted({c["id"]: c["labels"]["flare-airflow.round"] for c in ours}.values()),
    } == {
        "states": expected,
        "round 1 counted": ["site-2", "site-3", "site-4"],
        "round 1 refused site-1, saying": True,
        "round 2 counted": ["site-1", "site-3", "site-4"],
        "site-2 refused the replaced global, saying": True,
        "site-2 containers, by round": ["1"],
    }, (round_1["rejected"], failure)
    assert _xcom(deployment, run_id, "publish", "return_value")["final_model"].startswith("s3://")


def run_id_part(run_id: str) -> str:
    """How the store names ``run_id``'s folder (core/store.py: the run directory's name)."""
    from flare_airflow.core.store import ModelStore

    return ModelStore.from_uri("s3://flare/store").run_dir("digits", run_id).name


def _record(key: str) -> str:
    return key.removesuffix(".safetensors") + ".json"


def _get(s3: Any, key: str) -> bytes:
    return bytes(s3.client().get_object(Bucket="flare", Key=key)["Body"].read())
