"""Sites at the sites, for the tests: the central Airflow with the Edge executor, one Edge worker per
site, and an S3 store (flare_airflow_testing/s3_server.py), set up as docs/deploy-across-sites.md says.

Central: api-server (with the Edge worker API), scheduler (``LocalExecutor,EdgeExecutor``: the
central tasks on the first, the site tasks on the Edge workers), dag-processor and triggerer on
PostgreSQL (flare_airflow_testing/stack.py). A site: ``airflow edge worker --queues <site>`` with an Airflow home,
DAGs folder, site policy and site key of its own, and no database: it reaches the central side only
through the API server's URL, signing its calls with its site's key (``flare-airflow site worker``),
and the store only through its own connection. No party holds a shared secret: the central side
signs its tokens with its own Ed25519 key, and the consortium registry (every party's public key
and each site's grant) is the one file every side has.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import yaml

from flare_airflow_testing import deploy_guide as guide
from flare_airflow_testing.harness import REPO
from flare_airflow_testing.netns import Namespaces
from flare_airflow_testing.ports import free_port
from flare_airflow_testing.s3_server import S3Server
from flare_airflow_testing.stack import BIN, AirflowStack, Postgres, start_triggerer

STORE = "s3://flare/store"
CENTRAL_CONN = "flare_store"  # the job's store_conn_id: the central side's credentials
SITE_CONN = guide.store_connection_name()  # each site's policy names its own (its own credentials)
# The guide's timings, shortened so that the test is quick: a worker heartbeat every 2 s (guide:
# 10), a site task whose worker died failed after 15 s without a heartbeat (guide: 60), checked
# every 3 s; workers poll for jobs every second.
SITE_DATA_ENV = "DIGITS_SITE_DATA"  # examples/digits/trainer.py: a site's own shard of the demo data
FASTER_CENTRAL = {
    "AIRFLOW__EDGE__HEARTBEAT_INTERVAL": "2",
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "15",
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "3",
    # The DAG files never change once the deployment starts: parsed once, not every 30 s (a parse
    # of the job's DAG costs the central side ~1 s of CPU; docs/scale.md).
    "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
}
FASTER_WORKER = {"AIRFLOW__EDGE__JOB_POLL_INTERVAL": "1", "AIRFLOW__EDGE__HEARTBEAT_INTERVAL": "2"}


def edge_job(dags: pathlib.Path, *, rounds: int, container_sites: Mapping[str, str] | None = None) -> pathlib.Path:
    """The demo job (dags/digits.yaml) with the keys of the guide's 'The job' block; the sites of
    ``container_sites`` (site -> trainer image) run containers (the guide's 'Container sites at a site')."""
    # The demo job's files only: every other DAG would be parsed by the central side for nothing.
    dags.mkdir(parents=True, exist_ok=True)
    for name in ("digits.yaml", "digits_dag.py"):
        shutil.copy(REPO / "dags" / name, dags / name)
    shutil.copytree(
        REPO / "examples" / "digits", dags.parent / "examples" / "digits", ignore=shutil.ignore_patterns("__pycache__")
    )
    path = dags / "digits.yaml"
    job: dict[str, Any] = yaml.safe_load(path.read_text())
    keys = guide.job_keys()
    job.update({k: v for k, v in keys.items() if k != "sites"}, rounds=rounds)
    for site, entry in keys["sites"].items():
        job["sites"].setdefault(site, {}).update(entry)
    for site, image in (container_sites or {}).items():
        job["sites"][site].update(launcher="container", launcher_spec={"container": {"image": image}})
    # No retries: a site whose worker is gone fails at once and the round goes on within quorum.
    job["sites"]["@default"]["retries"] = 0
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def site_queue(job: pathlib.Path, site: str) -> str:
    """The queue of ``site``'s tasks in ``job`` (``site_queues: true``: the site's name unless its entry says)."""
    entry = yaml.safe_load(job.read_text())["sites"].get(site) or {}
    return str(entry.get("queue") or site)


def central_env(base: str, root: pathlib.Path) -> dict[str, str]:
    """The central side's environment: the guide's airflow.cfg for the API at ``base`` with its
    files under ``root`` (the token key, its key directory, the registry: :func:`enrol`), and this
    module's shorter timings."""
    return {**guide.central_config(base=base, root=root), **FASTER_CENTRAL}


def make_token_key(path: pathlib.Path) -> None:
    """The central side's token key (the guide's ``openssl genpkey -algorithm ed25519``), 0600."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.touch(mode=0o600)
    path.write_bytes(pem)


def enrol(
    central_root: pathlib.Path, workers: list[EdgeWorker], store_endpoint: Callable[[EdgeWorker], str] | None = None
) -> pathlib.Path:
    """The guide's 'Keys, the registry and what a site may ask' for this deployment: each site's
    keys made at its worker, the central keys and token key at the central side, every public key
    enrolled in one registry with each site's grant (its queue, its worker's name), and the
    registry copied to every worker. Returns the central registry's path."""
    from flare_airflow.core.trust import CENTRAL, generate_keys
    from flare_airflow.core.trust.keys import party_dir

    make_token_key(central_root / "central" / "jwt.pem")
    # The central box key: sites seal their reports (counts, metrics, privacy spent) to it.
    keys = generate_keys(CENTRAL, party_dir(central_root / "keys", CENTRAL)).jwks["keys"]
    grants: dict[str, dict[str, Any]] = {}
    for w in workers:
        keys += generate_keys(w.site, party_dir(w.root / "keys", w.site)).jwks["keys"]
        grants[w.site] = {"queues": [w.queue], "workers": [w.name]}
        if store_endpoint is not None:
            # Each site sees the central side at an address of its own link: its store links are
            # signed for that address.
            grants[w.site]["store_endpoint"] = store_endpoint(w)
    registry = central_root / "registry.json"
    registry.write_text(json.dumps({"keys": keys, "flare_sites": grants}, indent=1))
    for w in workers:
        shutil.copy(registry, w.root / "registry.json")
    return registry


class EdgeWorker:
    """One site's worker: ``airflow edge worker --queues <site>``, in its own session."""

    def __init__(
        self,
        root: pathlib.Path,
        site: str,
        stack: AirflowStack,
        s3: S3Server,
        *,
        prefix: list[str] | None = None,
        central: str | None = None,
        private_data: bool = False,
        container_image: str | None = None,
        queue: str | None = None,
    ) -> None:
        # ``prefix``: run in the site's network namespace; ``central``: the central side's address
        # as seen from there (default: the test process's view, the API's base URL).
        self.prefix = list(prefix or [])
        self.central = central
        # ``private_data`` (inside its namespaces only): the site's shard of the demo data on a
        # tmpfs that only this worker's mount namespace has (flare_airflow_testing/site_data.py); its policy
        # points the trainer there. ``container_image``: a container site running that image (its
        # policy is the guide's container site policy; the trainer reads the image's demo data).
        self.private_data = private_data
        self.site = site
        self.name = f"{site}-worker"
        self.root = root / self.name
        self.root.mkdir(parents=True)
        # The site's own copy of the DAGs and trainer (what a site admin deploys).
        if (stack.dags.parent / "examples").is_dir():
            shutil.copytree(stack.dags.parent / "examples", self.root / "examples")
        shutil.copytree(stack.dags, self.root / "dags", ignore=shutil.ignore_patterns("__pycache__"))
        self.data = self.root / "data"
        self.data.mkdir()
        if container_image is not None:
            policy = guide.container_site_policy(site, self.root, container_image)
        else:
            policy = guide.site_policy(site, self.root)
            process = policy["sites"][site]["launcher_spec"]["process"]
            pathlib.Path(process["cwd"]).mkdir(parents=True, exist_ok=True)
            if not private_data:
                # The guide's policy points the trainer at the site's own shard (on a tmpfs only the
                # worker's namespace has); without namespaces the trainer reads the shared demo data.
                process.get("env", {}).pop(SITE_DATA_ENV, None)
        self.policy = self.root / "site.yaml"
        self.policy.write_text(yaml.safe_dump(policy))
        # ``queue``: the queue it serves (default: the site's queue in the deployment's digits job).
        self.queue = queue or site_queue(stack.dags / "digits.yaml", site)
        self.stack, self.s3 = stack, s3
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self, secret: str | None = None, *, connection: bool = True) -> dict[str, str]:
        """A site worker's whole configuration (docs/deploy-across-sites.md, 'A site's worker')."""
        keep = ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "PYTHONWARNINGS")
        env = {k: v for k, v in os.environ.items() if k in keep}
        base = f"http://{self.central}:{self.stack.port}" if self.central else self.stack.base
        env.update(
            guide.worker_env(base=base, root=self.root, store_connection=self.s3.connection(secret, self.central))
        )
        if not connection:  # the site admin forgot to define it
            del env["AIRFLOW_CONN_" + SITE_CONN.upper()]
        env.update(FASTER_WORKER)
        env["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
        env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] = str(free_port())
        return env

    def start(self, secret: str | None = None, *, connection: bool = True) -> None:
        log = open(self.root / "worker.log", "ab")  # noqa: SIM115 - lives as long as the process
        command, *args = guide.worker_argv(self.site)
        cmd = [str(BIN / command), *args, "--", "--concurrency", "2"]
        if self.private_data:
            job = yaml.safe_load((self.root / "dags" / "digits.yaml").read_text())
            trainer = [str(self.root / "examples" / "digits" / "trainer.py"), *job["trainer"]["args"]]
            wrapper = [
                sys.executable,
                str(pathlib.Path(__file__).with_name("site_data.py")),
                str(self.data),
                self.site,
                *trainer,
                "--",
            ]
            cmd = [*wrapper, *cmd]
        self.proc = subprocess.Popen(
            [*self.prefix, *cmd],
            env=self.env(secret, connection=connection),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.root,
        )

    def kill(self) -> None:
        """The site's machine goes away: the worker and every task process it runs, at once.

        By session, not process group: the worker puts each task's supervisor in a group of its own.
        """
        if self.proc is not None:
            for pid in _session(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        self.kill()


def _session(sid: int) -> list[int]:
    """Every process of session ``sid`` (field 6 of /proc/PID/stat)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        if int(raw[raw.rfind(b")") + 2 :].split()[3]) == sid:
            found.append(int(entry))
    return found


class EdgeDeployment:
    """PostgreSQL, the central Airflow, the S3 endpoint and one worker per site."""

    def __init__(
        self,
        root: pathlib.Path,
        sites: list[str],
        rounds: int,
        *,
        isolated: bool = False,
        container_sites: Mapping[str, str] | None = None,
        extra_dags: Mapping[str, str] | None = None,
    ) -> None:
        """``isolated``: the central side in a network namespace, each site's worker in one of its
        own that reaches only the central side's API and S3 endpoint (flare_airflow_testing/netns.py).
        ``container_sites``: site -> trainer image, the sites whose jobs run as containers.
        ``extra_dags``: file name -> source of more DAG files, on the central side and every worker."""
        container_sites = dict(container_sites or {})
        self.ns = Namespaces(sites) if isolated else None
        central = Namespaces.prefix(self.ns.central) if self.ns else None
        host = self.ns.central_addr if self.ns else "127.0.0.1"
        port = free_port()
        self.central_root = root / "central"
        try:
            # Sites reach the store only through the links the central side presigned (strict mode),
            # and the store checks them: IAM on, every request signed by a known key, links too.
            self.s3 = S3Server(host, prefix=central)
            self.pg = Postgres(prefix=central)
            extra = central_env(f"http://{host}:{port}", self.central_root)
            self.stack = AirflowStack(root, self.pg.url, extra_env=extra, prefix=central, host=host, port=port)
        except BaseException:
            self._remove_namespaces()
            raise
        # No shared secret anywhere: the central side signs with its token key only.
        self.stack.env.pop("AIRFLOW__API_AUTH__JWT_SECRET", None)
        # The central tasks reach the store on their own loopback.
        self.stack.env["AIRFLOW_CONN_" + CENTRAL_CONN.upper()] = self.s3.connection(host="127.0.0.1")
        self.job = edge_job(self.stack.dags, rounds=rounds, container_sites=container_sites)
        for name, source in (extra_dags or {}).items():
            (self.stack.dags / name).write_text(source)
        self.workers = {
            site: EdgeWorker(
                root,
                site,
                self.stack,
                self.s3,
                prefix=Namespaces.prefix(self.ns.site_ns[site]) if self.ns else None,
                central=self.ns.site_peer[site] if self.ns else None,
                private_data=isolated,
                container_image=container_sites.get(site),
            )
            for site in sites
        }
        self.registry = enrol(
            self.central_root,
            list(self.workers.values()),
            (lambda w: f"http://{w.central}:{self.s3.port}") if self.ns else None,
        )

    def _remove_namespaces(self) -> None:
        if self.ns is not None:
            self.ns.remove()

    def start(self) -> None:
        self.stack.start()
        start_triggerer(self.stack)
        for worker in self.workers.values():
            worker.start()
        self.wait_workers(set(self.workers))

    def restart_workers(self, starts: Mapping[str, Mapping[str, Any]]) -> None:
        """Restart the workers of ``starts`` (site -> :meth:`EdgeWorker.start`'s keywords) at once:
        all stopped, all started, then until all are up (each stop and start takes seconds)."""
        workers = [self.workers[site] for site in starts]
        with ThreadPoolExecutor(len(workers)) as pool:
            list(pool.map(EdgeWorker.stop, workers))
        for worker in workers:
            worker.start(**starts[worker.site])
        self.wait_workers(set(starts))

    def wait_workers(self, sites: set[str], timeout: float = 90) -> None:
        """Until the workers of ``sites`` are registered and idle (the API's worker list)."""
        names = {self.workers[s].name for s in sites}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = {w["worker_name"] for w in self.edge_workers() if w.get("state") in ("idle", "running")}
            if names <= up:
                return
            time.sleep(1)
        raise RuntimeError(f"edge workers {sorted(names)} did not come up; see {self.stack.root}/*/worker.log")

    def site_key(self, site: str) -> tuple[str, Any]:
        """(key id, signing key) of ``site``: what its worker holds, for tests that act as that site."""
        from flare_airflow.core.trust.keys import load_signing_key, party_dir

        return load_signing_key(party_dir(self.workers[site].root / "keys", site), site)

    def edge_workers(self) -> list[dict[str, Any]]:
        import httpx

        r = httpx.get(
            f"{self.stack.base}/edge_worker/ui/worker",
            headers={"Authorization": f"Bearer {self.stack._token}"},
            timeout=10,
        )
        r.raise_for_status()
        return list(r.json().get("workers", []))

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()
        self.stack.stop()
        self.pg.stop()
        self.s3.stop()
        self._remove_namespaces()
