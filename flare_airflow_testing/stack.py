"""Real Airflow with a real scheduler, for the tests where scheduling is what is tested.

PostgreSQL: a private cluster (``initdb`` + ``pg_ctl``, fsync off) on a free loopback port, run as
the ``postgres`` user. Airflow: ``api-server`` (which also serves the execution API the workers
use), ``scheduler`` (LocalExecutor) and ``dag-processor``, each in its own session so that
``stop()`` kills their whole process groups. Nothing here is mocked.

``airflow db migrate`` runs once per process: the first stack's freshly migrated database is kept
as a ``pg_dump`` and as a template database in its cluster. A later stack in the same cluster is
``CREATE DATABASE ... TEMPLATE`` of it (a file copy, ~0.3 s); in another cluster it restores the dump
(~1 s); a migration takes 10-30 s. The schema and the rows a migration writes are the same for every
stack of one Airflow install.

The test suite shares one PostgreSQL cluster per pytest worker (:func:`postgres`, session-scoped) and
gives each module's stack a database of its own in it (:func:`scheduler_stack`): starting and stopping
a cluster per module cost ~7 s of each module's setup and teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import itertools
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from flare_airflow_testing.ports import free_port

BIN = pathlib.Path(sys.executable).parent


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} is not installed (apt-get install postgresql); .ci/run installs it")
    return found[-1]


class Postgres:
    def __init__(self, prefix: list[str] | None = None) -> None:
        # ``prefix``: e.g. ``ip netns exec NS`` to run the server in a network namespace.
        self.prefix = list(prefix or [])
        # Not under pytest's tmp_path: its parents are private to root and postgres must reach it.
        root = pathlib.Path(tempfile.mkdtemp(prefix="flare-pg-"))
        root.chmod(0o755)
        shutil.chown(root, "postgres", "postgres")
        self.root = root
        self.data = root / "pgdata"
        self.port = free_port()
        self._as_postgres([_pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8"])
        with open(self.data / "postgresql.conf", "a") as fh:
            fh.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{root}'\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 200\n"
            )
        self._as_postgres([_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(root / "pg.log"), "-w", "start"])
        self._as_postgres([_pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "airflow"])

    def _as_postgres(self, cmd: list[str]) -> None:
        out = subprocess.run(
            [*self.prefix, "runuser", "-u", "postgres", "--", *cmd], capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stdout}{out.stderr}")

    @property
    def url(self) -> str:
        return self.url_for("airflow")

    def url_for(self, database: str) -> str:
        """The URL of ``database`` in this cluster (created by the first stack that migrates it)."""
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        self._as_postgres([_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"])
        shutil.rmtree(self.root, ignore_errors=True)


class AirflowStack:
    """api-server + scheduler + dag-processor on PostgreSQL, with a dags folder of its own."""

    USER = "admin"

    def __init__(
        self,
        root: pathlib.Path,
        db_url: str,
        parallelism: int = 4,
        extra_env: dict[str, str] | None = None,
        *,
        prefix: list[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        # ``prefix`` (e.g. ``ip netns exec NS``) runs every component in a network namespace, whose
        # address ``host`` the API listens on (all of the namespace's addresses) and is reached at.
        self.prefix = list(prefix or [])
        self.root = root
        self.home = root / "airflow"
        self.dags = root / "dags"
        self.home.mkdir(parents=True)
        self.dags.mkdir()
        self.port = port or free_port()
        self.password = secrets.token_urlsafe(12)
        passwords = self.home / "passwords.json"
        passwords.write_text(json.dumps({self.USER: self.password}))
        self.base = f"http://{host}:{self.port}"
        self.env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(parallelism),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{self.USER}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
            "AIRFLOW__API__HOST": "0.0.0.0" if self.prefix else "127.0.0.1",  # in its namespace: all its addresses
            "AIRFLOW__API__PORT": str(self.port),
            # The workers' and the triggerer's log servers default to 8793/8794: another stack (or
            # a leftover of one) on the machine would hold them.
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__API__BASE_URL": self.base,
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
            "AIRFLOW_CONN_FLARE_AIRFLOW_API": json.dumps(
                {"conn_type": "http", "host": self.base, "login": self.USER, "password": self.password}
            ),
            "PYTHONWARNINGS": "ignore::DeprecationWarning",
            **(extra_env or {}),
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        # A stack in a network namespace (or with settings of its own) migrates its database itself:
        # the dump is taken and restored over this namespace's loopback, with the default settings.
        if self.prefix or extra_env:
            self.airflow("db", "migrate")
        else:
            _MIGRATED.migrate(self, db_url)

    def airflow(self, *args: str) -> str:
        out = subprocess.run(
            [*self.prefix, str(BIN / "airflow"), *args], env=self.env, capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            raise RuntimeError(f"airflow {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out.stdout

    def start(self) -> None:
        for component in ("api-server", "scheduler", "dag-processor"):
            log = open(self.root / f"{component}.log", "wb")  # noqa: SIM115 - lives as long as the process
            self.procs.append(
                subprocess.Popen(
                    [*self.prefix, str(BIN / "airflow"), component],
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/api/v2/monitor/health", timeout=2).status_code == 200:
                    self._token = self._login()
                    return
            except httpx.HTTPError:
                pass
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"an Airflow component exited: see {self.root}/*.log")
            time.sleep(0.5)
        raise RuntimeError(f"the Airflow API did not come up in 120 s; see {self.root}/api-server.log")

    def _login(self) -> str:
        r = httpx.post(f"{self.base}/auth/token", json={"username": self.USER, "password": self.password}, timeout=10)
        r.raise_for_status()
        return str(r.json()["access_token"])

    def api(self, method: str, path: str, **kw: Any) -> Any:
        # A GET is asked again when a loaded machine (8 engineers on 2 cores) keeps the API from
        # answering in time; anything else is not idempotent and is asked once.
        for attempt in range(3 if method == "GET" else 1):
            try:
                r = httpx.request(
                    method,
                    f"{self.base}/api/v2{path}",
                    headers={"Authorization": f"Bearer {self._token}"},
                    # A write is asked once: give it the time a loaded api-server needs.
                    timeout=30 if method == "GET" else 120,
                    **kw,
                )
                break
            except httpx.TimeoutException:
                if attempt == (2 if method == "GET" else 0):
                    raise
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")
        return r.json() if r.content else None

    def wait_for_dag(self, dag_id: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.api("GET", f"/dags/{dag_id}")
                return
            except RuntimeError:
                time.sleep(1)
        errors = self.api("GET", "/importErrors")
        raise RuntimeError(f"DAG {dag_id} was not parsed in {timeout}s; import errors: {errors}")

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        self.wait_for_dag(dag_id)
        self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf or {}})
        return str(run["dag_run_id"])

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
            if state in ("success", "failed"):
                return str(state)
            time.sleep(1)
        raise RuntimeError(f"run {run_id} of {dag_id} did not finish in {timeout}s")

    def task_instances(self, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
        # The API caps a page at api.maximum_page_limit (100): page through.
        out: dict[str, dict[str, Any]] = {}
        while True:
            body = self.api(
                "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100, "offset": len(out)}
            )
            out.update((ti["task_id"], ti) for ti in body["task_instances"])
            if not body["task_instances"] or len(out) >= body["total_entries"]:
                return out

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for p in self.procs:  # anything left in the groups (task processes)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


# Drills that kill a worker or a supervisor: the scheduler fails a try that stopped heartbeating after
# 12 s (Airflow's default is 300 s).
HEARTBEAT_DRILL_ENV = {
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "12",
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
    "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
}
_databases = itertools.count(1)


@contextlib.contextmanager
def scheduler_stack(
    root: pathlib.Path,
    env: dict[str, str] | None = None,
    *,
    postgres: Postgres | None = None,
    triggerer: bool = False,
    start: bool = True,
    **kwargs: Any,
) -> Iterator[AirflowStack]:
    """An Airflow stack on a database of its own (``kwargs`` go to :class:`AirflowStack`, ``env`` into
    its environment), started (with a triggerer when ``triggerer``; not at all when ``start`` is
    false: the caller starts it); stopped afterwards, also when the start fails.

    ``postgres``: the cluster to make the database in (the suite's shared one); without one a private
    cluster is started and stopped with the stack.
    """
    pg = postgres or Postgres()
    database = f"airflow_{os.getpid()}_{next(_databases)}" if postgres else "airflow"
    try:
        airflow = AirflowStack(root / "af", pg.url_for(database), **kwargs)
        airflow.env.update(env or {})
        try:
            if start:
                airflow.start()
                if triggerer:
                    start_triggerer(airflow)
            yield airflow
        finally:
            airflow.stop()
    finally:
        # A database in the shared cluster stays until the cluster ends with the session: dropping it
        # took 1.3-2.1 s (measured), and no other stack uses its name.
        if not postgres:
            pg.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """One PostgreSQL cluster per pytest worker; each module's stack gets a database of its own."""
    pg = Postgres()
    try:
        yield pg
    finally:
        pg.stop()


TEMPLATE = "flare_migrated"


class _MigratedDatabase:
    """The first stack's database right after ``airflow db migrate`` (a ``pg_dump``, and a template
    database in its cluster) and the ``airflow.cfg`` Airflow generated in its home; later stacks copy
    the template (same cluster) or restore the dump (another cluster), and copy the configuration."""

    def __init__(self) -> None:
        self.dir: pathlib.Path | None = None
        self.home = ""

    def migrate(self, stack: AirflowStack, db_url: str) -> None:
        from sqlalchemy.engine import make_url

        database = str(make_url(db_url).database)
        # Asked of the cluster, not remembered by port: a later cluster may get a stopped one's port.
        if _has_database(db_url, TEMPLATE):
            _sql(db_url, f'DROP DATABASE IF EXISTS "{database}"')
            _sql(db_url, f'CREATE DATABASE "{database}" TEMPLATE "{TEMPLATE}"')
        else:
            if not _has_database(db_url, database):
                _sql(db_url, f'CREATE DATABASE "{database}"')
            if self.dir is None:
                stack.airflow("db", "migrate")
                dump_dir = pathlib.Path(tempfile.mkdtemp(prefix="flare-migrated-"))
                atexit.register(shutil.rmtree, dump_dir, True)
                _pg_tool("pg_dump", db_url, "--format=custom", f"--file={dump_dir / 'airflow.dump'}")
                shutil.copyfile(stack.home / "airflow.cfg", dump_dir / "airflow.cfg")
                self.dir, self.home = dump_dir, str(stack.home)
            else:
                _pg_tool("pg_restore", db_url, "--exit-on-error", "--no-owner", str(self.dir / "airflow.dump"))
            # Nothing is connected to the database between the migration and the stack's start.
            _sql(db_url, f'CREATE DATABASE "{TEMPLATE}" TEMPLATE "{database}"')
        if self.home != str(stack.home):
            # Without airflow.cfg each component would generate its own (a fernet key each) at start.
            assert self.dir is not None
            cfg = (self.dir / "airflow.cfg").read_text().replace(self.home, str(stack.home))
            (stack.home / "airflow.cfg").write_text(cfg)


def _pg_tool(name: str, db_url: str, *args: str) -> str:
    """PostgreSQL's client ``name`` (psql, pg_dump, pg_restore) on the database of ``db_url``."""
    from sqlalchemy.engine import make_url

    url = make_url(db_url)
    where = ["-h", str(url.host), "-p", str(url.port), "-U", str(url.username), "-d", str(url.database)]
    out = subprocess.run([_pg_bin(name), *where, *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{name} of {db_url} failed: {out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out.stdout


def _has_database(db_url: str, name: str) -> bool:
    return bool(_sql(db_url, f"SELECT 1 FROM pg_database WHERE datname = '{name}'").strip())


def _sql(db_url: str, statement: str) -> str:
    """``statement`` run by psql in the cluster of ``db_url``, in its maintenance database (``CREATE
    DATABASE`` and ``DROP DATABASE`` cannot run in the database they name); its rows, unaligned."""
    from sqlalchemy.engine import make_url

    maintenance = make_url(db_url).set(database="postgres").render_as_string(hide_password=False)
    return _pg_tool("psql", maintenance, "-v", "ON_ERROR_STOP=1", "-tAc", statement)


_MIGRATED = _MigratedDatabase()


# ---------------------------------------------------------------- processes of site jobs (kill drills)


def _environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def parent_of(pid: int) -> int | None:
    """The parent pid from ``/proc/PID/stat``, or ``None`` once the process is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[1])


def alive(pid: int) -> bool:
    return parent_of(pid) is not None


def site_processes(marker: str) -> dict[int, dict[str, Any]]:
    """Site runners and trainers (and anything a trainer started) whose environment mentions
    ``marker`` (a store root or run id unique to a test): ``{pid: {kind, run_id, site, round, ppid}}``.

    A site runner carries its site job in ``FLARE_SITE_JOB_SPEC``; a trainer and its descendants
    carry ``FLARE_PROCESS_TREE`` and the Client API variables (``FLARE_RUN_ID``, ``FLARE_SITE``...).
    """
    found: dict[int, dict[str, Any]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        env = _environ(pid)
        if not env:
            continue
        spec, tree = env.get("FLARE_SITE_JOB_SPEC"), env.get("FLARE_PROCESS_TREE")
        if spec and marker in spec:
            data = json.loads(spec)
            info = {"kind": "runner", "run_id": data["run_id"], "site": data["site"], "round": data["round"]}
        elif tree and any(marker in value for value in env.values()):
            info = {
                "kind": "trainer",
                "run_id": env.get("FLARE_RUN_ID"),
                "site": env.get("FLARE_SITE"),
                "round": int(env.get("FLARE_ROUND", "0")),
            }
        else:
            continue
        ppid = parent_of(pid)
        if ppid is not None:
            found[pid] = {**info, "ppid": ppid}
    return found


def wait_gone(pids: list[int], timeout: float) -> float | None:
    """Seconds until every one of ``pids`` has ended, or ``None`` if some still run after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not any(alive(p) for p in pids):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def kill9(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def start_triggerer(stack: AirflowStack) -> None:
    """The triggerer in its own session, ended with the other components' process groups by ``stop()``."""
    log = open(stack.root / "triggerer.log", "wb")  # noqa: SIM115 - lives as long as the process
    stack.procs.append(
        subprocess.Popen(
            [*stack.prefix, str(BIN / "airflow"), "triggerer"],
            env=stack.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
