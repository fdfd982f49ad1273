"""A real Kubernetes control plane on loopback, for tests: etcd + kube-apiserver + kube-scheduler +
kube-controller-manager (v1.20.2 built from Debian's source package by ``k8s/build-control-plane.sh``).

There is no kubelet and no container runtime: :mod:`flare_airflow_testing.k8s.node_agent` plays the node.

Everything lives under one private run directory (certs, tokens, kubeconfigs, etcd data, logs, the
audit log, ``state.json``). Every process runs in its own session (process group) and
:meth:`ControlPlane.stop` kills those groups, so nothing is left running. Usable from a pytest
fixture (``ControlPlane(run_dir).start()`` / ``.stop()``) and from the shell through
``k8s/control-plane.sh start|stop|env`` (``python -m flare_airflow_testing.k8s.control_plane``).

Only the standard library is imported here (kubeconfigs are written as JSON, which is YAML), so the
shell entry point works with any Python 3.11.

Users (static token file, all in ``system:masters`` but with distinct names so the audit log tells
them apart): ``flare-admin`` (tests and clients), ``flare-node-agent`` (the node agent),
``system:kube-scheduler`` and ``system:kube-controller-manager``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from flare_airflow_testing import background
from flare_airflow_testing.ports import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "k8s" / "build-control-plane.sh"
DEFAULT_BIN = "/opt/flare-airflow/k8s-1.20.2/bin"
K8S_BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
SERVICE_CIDR = "10.96.0.0/16"

# name in the kubeconfig/token file -> (user name, groups)
USERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "admin": ("flare-admin", ("system:masters",)),
    "node": ("flare-node-agent", ("system:masters", "system:nodes")),
    "scheduler": ("system:kube-scheduler", ("system:masters",)),
    "controller-manager": ("system:kube-controller-manager", ("system:masters",)),
}
CONTROL_PLANE_USERS = frozenset({USERS["scheduler"][0], USERS["controller-manager"][0]})

AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
# One event per request when it completes (plus ResponseStarted for watches and log streams).
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
"""


class ControlPlaneError(RuntimeError):
    """The control plane could not be built or started (never a reason to skip a test)."""


def bin_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FLARE_K8S_BIN", DEFAULT_BIN))


def binaries_present() -> bool:
    return all(os.access(bin_dir() / b, os.X_OK) for b in K8S_BINARIES) and shutil.which("etcd") is not None


def ensure_binaries(build: bool = True, log_path: pathlib.Path | None = None) -> pathlib.Path:
    """Return the binary directory, running ``k8s/build-control-plane.sh`` first when anything is missing."""
    # `make test` builds them in the background (flare_airflow_testing/background.py): wait for that
    # build, and fail with its log, rather than start a second one that would wait on its lock.
    background.wait_for("control-plane")
    if binaries_present():
        return bin_dir()
    if not build:
        raise ControlPlaneError(f"control plane binaries missing in {bin_dir()} (run {BUILD_SCRIPT})")
    started = time.monotonic()
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - closed below
    try:
        proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=out, stderr=subprocess.STDOUT, check=False)
    finally:
        if out:
            out.close()
    if proc.returncode != 0 or not binaries_present():
        detail = ""
        if log_path:
            tail = log_path.read_text(errors="replace").splitlines()[-40:] if log_path.exists() else []
            detail = f"; log {log_path}:\n" + "\n".join(tail)
        raise ControlPlaneError(f"{BUILD_SCRIPT} failed (exit {proc.returncode}){detail}")
    print(f"[k8s_harness] built control plane in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return bin_dir()


@dataclass
class _State:
    run_dir: str
    api_port: int = 0
    etcd_port: int = 0
    etcd_peer_port: int = 0
    scheduler_port: int = 0
    controller_manager_port: int = 0
    pids: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    etcd_data_dir: str = ""


class ControlPlane:
    """etcd + kube-apiserver + kube-scheduler + kube-controller-manager under ``run_dir``.

    ``api_port``: a free ephemeral port unless one is passed. ``die_with_parent``: the
    processes get SIGKILL when the Python process that started them dies (pytest); the shell entry
    point turns it off so the control plane outlives ``start``. ``etcd_on_tmpfs``: put etcd's data
    under /dev/shm (faster; removed by ``stop``).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        api_port: int | None = None,
        die_with_parent: bool = True,
        etcd_on_tmpfs: bool | None = None,
        build: bool = True,
    ) -> None:
        self.run_dir = pathlib.Path(run_dir or tempfile.mkdtemp(prefix="flare-k8s-")).resolve()
        self._requested_port = api_port
        self.die_with_parent = die_with_parent
        if etcd_on_tmpfs is None:
            etcd_on_tmpfs = os.environ.get("FLARE_K8S_ETCD_TMPFS", "1") != "0" and os.path.isdir("/dev/shm")
        self.etcd_on_tmpfs = etcd_on_tmpfs
        self.build = build
        self.state = _State(run_dir=str(self.run_dir))
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.start_seconds: float | None = None

    # ----------------------------------------------------------------- paths
    @property
    def logs_dir(self) -> pathlib.Path:
        return self.run_dir / "logs"

    @property
    def audit_log(self) -> pathlib.Path:
        return self.logs_dir / "audit.log"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.state.api_port}"

    @property
    def ca_file(self) -> pathlib.Path:
        return self.run_dir / "certs" / "apiserver" / "apiserver.crt"

    def kubeconfig_path(self, user: str = "admin") -> pathlib.Path:
        return self.run_dir / f"kubeconfig-{user}.yaml"

    @property
    def kubeconfig(self) -> pathlib.Path:
        """Kubeconfig for tests and clients (user ``flare-admin``, TLS verified against the apiserver's CA)."""
        return self.kubeconfig_path("admin")

    def token(self, user: str = "admin") -> str:
        return self.state.tokens[user]

    def env(self) -> dict[str, str]:
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "FLARE_K8S_RUN_DIR": str(self.run_dir),
            "FLARE_K8S_SERVER": self.server,
            "FLARE_K8S_AUDIT_LOG": str(self.audit_log),
        }

    def api_client(self, user: str = "admin") -> Any:
        """A ``kubernetes.client.ApiClient`` for ``user`` (imports the kubernetes package lazily)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig_path(user)))

    # ----------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 90.0) -> ControlPlane:
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ensure_binaries(self.build, self.run_dir / "build.log")
        bins = bin_dir()
        for sub in ("logs", "certs/apiserver", "certs/scheduler", "certs/controller-manager"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
        st = self.state
        # An ephemeral port unless one is asked for: two test sessions on one machine must not race for 6443.
        st.api_port = free_port(self._requested_port)
        st.etcd_port = free_port()
        st.etcd_peer_port = free_port()
        st.scheduler_port = free_port()
        st.controller_manager_port = free_port()
        if self.etcd_on_tmpfs:
            st.etcd_data_dir = tempfile.mkdtemp(prefix="flare-etcd-", dir="/dev/shm")
        else:
            st.etcd_data_dir = str(self.run_dir / "etcd-data")
            os.makedirs(st.etcd_data_dir, mode=0o700, exist_ok=True)
        self._write_credentials()
        try:
            self._spawn(
                "etcd",
                [
                    shutil.which("etcd") or "etcd",
                    "--name=flare",
                    f"--data-dir={st.etcd_data_dir}",
                    f"--listen-client-urls=http://127.0.0.1:{st.etcd_port}",
                    f"--advertise-client-urls=http://127.0.0.1:{st.etcd_port}",
                    f"--listen-peer-urls=http://127.0.0.1:{st.etcd_peer_port}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{st.etcd_peer_port}",
                    f"--initial-cluster=flare=http://127.0.0.1:{st.etcd_peer_port}",
                    "--initial-cluster-state=new",
                    "--logger=zap",
                    "--log-outputs=stderr",
                ],
            )
            self._wait("etcd", lambda: self._http_ok(f"http://127.0.0.1:{st.etcd_port}/health", b'"health":"true"'), 30)
            self._spawn(
                "kube-apiserver",
                [
                    str(bins / "kube-apiserver"),
                    f"--etcd-servers=http://127.0.0.1:{st.etcd_port}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={st.api_port}",
                    "--insecure-port=0",
                    f"--cert-dir={self.run_dir / 'certs' / 'apiserver'}",
                    f"--token-auth-file={self.run_dir / 'tokens.csv'}",
                    "--authorization-mode=RBAC",
                    "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                    f"--service-account-key-file={self.run_dir / 'sa.pub'}",
                    f"--service-account-signing-key-file={self.run_dir / 'sa.key'}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--disable-admission-plugins=ServiceAccount",
                    "--enable-priority-and-fairness=false",
                    "--kubelet-preferred-address-types=InternalIP",
                    "--allow-privileged=true",
                    "--profiling=false",
                    f"--audit-policy-file={self.run_dir / 'audit-policy.yaml'}",
                    f"--audit-log-path={self.audit_log}",
                    "--audit-log-format=json",
                    "--audit-log-maxsize=0",
                ],
            )
            self._wait("kube-apiserver", self._apiserver_ready, 60)
            self._write_kubeconfigs()
            for name, port in (
                ("kube-scheduler", st.scheduler_port),
                ("kube-controller-manager", st.controller_manager_port),
            ):
                user = "scheduler" if name == "kube-scheduler" else "controller-manager"
                kubeconfig = self.kubeconfig_path(user)
                argv = [
                    str(bins / name),
                    f"--kubeconfig={kubeconfig}",
                    f"--authentication-kubeconfig={kubeconfig}",
                    f"--authorization-kubeconfig={kubeconfig}",
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={port}",
                    "--port=0",
                    f"--cert-dir={self.run_dir / 'certs' / user}",
                    "--profiling=false",
                ]
                if name == "kube-controller-manager":
                    argv += [
                        # A simulated node sends no heartbeats: nodelifecycle would taint and evict.
                        "--controllers=*,-nodelifecycle",
                        f"--service-account-private-key-file={self.run_dir / 'sa.key'}",
                        f"--root-ca-file={self.ca_file}",
                        "--use-service-account-credentials=false",
                        # A PVC and its pre-bound PV created together can miss each other's events and
                        # wait for the periodic sync (default 15 s); it only walks the informer cache.
                        "--pvclaimbinder-sync-period=1s",
                    ]
                self._spawn(name, argv)
            for name, port in (
                ("kube-scheduler", st.scheduler_port),
                ("kube-controller-manager", st.controller_manager_port),
            ):
                self._wait(name, lambda p=port: self._http_ok(f"https://127.0.0.1:{p}/healthz", b"ok"), 60)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Kill every process group this control plane started (also when loaded from ``state.json``)."""
        for name in ("kube-controller-manager", "kube-scheduler", "kube-apiserver", "etcd"):
            pid = self.state.pids.get(name)
            if pid:
                _kill_group(pid, name, self._procs.get(name), timeout)
        self.state.pids.clear()
        self._procs.clear()
        self._save_state()
        if self.state.etcd_data_dir.startswith("/dev/shm/"):
            shutil.rmtree(self.state.etcd_data_dir, ignore_errors=True)

    def alive(self) -> dict[str, bool]:
        return {name: _pid_alive(pid, name) for name, pid in self.state.pids.items()}

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> ControlPlane:
        """A handle on a control plane started earlier (e.g. by ``k8s/control-plane.sh start``)."""
        cp = cls(run_dir, die_with_parent=False)
        data = json.loads((cp.run_dir / "state.json").read_text())
        cp.state = _State(**data)
        return cp

    # ----------------------------------------------------------------- internals
    def _write_credentials(self) -> None:
        rd = self.run_dir
        key = rd / "sa.key"
        if not key.exists():
            subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True, timeout=60)
            subprocess.run(
                ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(rd / "sa.pub")],
                check=True,
                capture_output=True,
                timeout=60,
            )
        self.state.tokens = {user: secrets.token_hex(24) for user in USERS}
        lines = []
        for user, (name, groups) in USERS.items():
            lines.append(f'{self.state.tokens[user]},{name},{name},"{",".join(groups)}"')
        tokens = rd / "tokens.csv"
        tokens.write_text("\n".join(lines) + "\n")
        tokens.chmod(0o600)
        (rd / "audit-policy.yaml").write_text(AUDIT_POLICY)
        self._save_state()

    def _write_kubeconfigs(self) -> None:
        for user in USERS:
            cluster: dict[str, Any] = {"server": self.server}
            if user in ("scheduler", "controller-manager"):
                cluster["insecure-skip-tls-verify"] = True
            else:
                cluster["certificate-authority"] = str(self.ca_file)
            cfg = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "flare", "cluster": cluster}],
                "users": [{"name": user, "user": {"token": self.state.tokens[user]}}],
                "contexts": [{"name": "flare", "context": {"cluster": "flare", "user": user, "namespace": "default"}}],
                "current-context": "flare",
            }
            path = self.kubeconfig_path(user)
            path.write_text(json.dumps(cfg, indent=2) + "\n")
            path.chmod(0o600)

    def _spawn(self, name: str, argv: list[str]) -> None:
        if self.die_with_parent and shutil.which("setpriv"):
            argv = ["setpriv", "--pdeathsig", "KILL", "--", *argv]
        with open(self.logs_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.run_dir,
                start_new_session=True,
            )
        self._procs[name] = proc
        self.state.pids[name] = proc.pid
        self._save_state()

    def _save_state(self) -> None:
        if self.run_dir.exists():
            path = self.run_dir / "state.json"
            path.write_text(json.dumps(asdict(self.state), indent=2) + "\n")
            path.chmod(0o600)

    def _wait(self, name: str, probe: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{self._log_tail(name)}")
            if probe():
                return
            time.sleep(0.2)
        raise ControlPlaneError(f"{name} not ready after {timeout:.0f} s:\n{self._log_tail(name)}")

    def _log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.logs_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _http_ok(self, url: str, expect: bytes, token: str | None = None, ca: pathlib.Path | None = None) -> bool:
        if url.startswith("https"):
            ctx = ssl.create_default_context(cafile=str(ca)) if ca else ssl._create_unverified_context()
        else:
            ctx = None
        req = urllib.request.Request(url)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
                return resp.status == 200 and expect in resp.read()
        except (OSError, urllib.error.URLError, ssl.SSLError):
            return False

    def _apiserver_ready(self) -> bool:
        if not self.ca_file.exists():
            return False
        return self._http_ok(f"{self.server}/readyz", b"ok", token=self.state.tokens["admin"], ca=self.ca_file)


def _pid_alive(pid: int, name: str) -> bool:
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state != "Z" and name.encode() in cmdline


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(pid: int, name: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM the process group led by ``pid``, SIGKILL after ``timeout``; reap it when it is our child."""
    if proc is None and not _pid_alive(pid, name):
        return  # exited already (or the pid now belongs to someone else): nothing of ours to kill
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()  # reap, or the zombie keeps the group "alive"
        if not _group_alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()
        if not _group_alive(pid):
            return
        time.sleep(0.05)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k8s/control-plane.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["start", "stop", "env", "status"])
    parser.add_argument(
        "--run-dir",
        default=os.environ.get("FLARE_K8S_RUN_DIR", os.path.join(tempfile.gettempdir(), "flare-k8s-run")),
    )
    parser.add_argument("--port", type=int, default=None, help="apiserver port (default: a free ephemeral port)")
    args = parser.parse_args(argv)
    run_dir = pathlib.Path(args.run_dir)
    if args.command == "start":
        if (run_dir / "state.json").exists():
            old = ControlPlane.load(run_dir)
            if any(old.alive().values()):
                print(f"already running in {run_dir}; stop it first", file=sys.stderr)
                return 1
        run_dir.mkdir(parents=True, exist_ok=True)
        cp = ControlPlane(run_dir, api_port=args.port, die_with_parent=False).start()
        print(f"# control plane ready in {cp.start_seconds:.1f} s", file=sys.stderr)
        for k, v in cp.env().items():
            print(f"export {k}={v}")
        return 0
    if not (run_dir / "state.json").exists():
        print(f"no control plane state in {run_dir}", file=sys.stderr)
        return 0 if args.command == "stop" else 1
    cp = ControlPlane.load(run_dir)
    if args.command == "stop":
        cp.stop()
    elif args.command == "env":
        for k, v in cp.env().items():
            print(f"export {k}={v}")
    else:
        alive = cp.alive()
        if not alive:
            print("not running")
        for name, ok in alive.items():
            print(f"{name}: {'running' if ok else 'stopped'}")
        return 0 if alive and all(alive.values()) else 3
    return 0


if __name__ == "__main__":
    sys.exit(_main())
