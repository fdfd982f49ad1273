"""A private single-node SLURM cluster for tests: munged + slurmctld + slurmd (Debian's Slurm 22.05),
started as children of the test session under one directory, with fake GPUs.

Everything lives under ``run_dir`` (``slurm.conf`` / ``gres.conf``, state, spool, logs and the fake
GPU devices) except munged's key, socket and log, which need a directory the ``munge`` user can
reach (a private ``/tmp/flare-munge-*``, removed at stop). The fake GPU devices are character
devices made with ``mknod ... c 195 N``: slurmd rejects plain files as ``File=`` entries. The
node declares more CPUs and memory than the machine has (``SlurmdParameters=config_overrides``),
so GPUs are the scarce resource and ``--gres=gpu:1`` jobs really queue ``PENDING (Resources)``
and each gets its own ``CUDA_VISIBLE_DEVICES``.

``nodes > 1``: one slurmd per node, each in its own network namespace (entered with ``nsenter``)
with its own address on a private bridge whose host side (``10.X.Y.1``) slurmctld and the clients
use: the nodes reach each other and the controller as separate machines would, so ``srun`` across
nodes and a trainer's TCP rendezvous really cross a network. Removed at stop.

Ports are free ports picked at start; clients need ``SLURM_CONF`` (:attr:`SlurmCluster.env`).
Daemons run in the foreground in their own sessions; :meth:`stop` ends each one's process group
and checks that nothing of the cluster is left. Never skipped: a daemon that cannot start raises
:class:`SlurmClusterError` with the end of its log.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from flare_airflow_testing.ports import free_port

GPUS = 4
CPUS = 16
MEMORY_MB = 16000
PARTITION = "flare"
NODE = "flare1"
_DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmClusterError(RuntimeError):
    """The cluster could not start (missing package, daemon failed): the tests using it fail."""


def _require(program: str) -> str:
    path = shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin:/usr/bin")
    if path is None:
        raise SlurmClusterError(
            f"{program} is not installed: run `make system-deps` (Debian slurmctld slurmd slurm-client munge)"
        )
    return path


class SlurmCluster:
    """munged + slurmctld + slurmd with ``gpus`` fake GPUs, under ``run_dir``."""

    def __init__(self, run_dir: Path, *, gpus: int = GPUS, cpus: int = CPUS, nodes: int = 1) -> None:
        self.run_dir = Path(run_dir)
        self.gpus = gpus
        self.cpus = cpus
        self.nodes = nodes
        self.net: NodeNetwork | None = NodeNetwork(nodes) if nodes > 1 else None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.start_seconds = 0.0
        self.partition = PARTITION
        self.node = NODE
        self.node_names = [NODE] if nodes == 1 else [f"{NODE}n{i}" for i in range(1, nodes + 1)]
        # munged runs as user munge and checks every directory above its socket and key: pytest's
        # temp dirs are private (0700), so its files live in a directory of their own under /tmp.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="flare-munge-"))

    # -- paths ----------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.run_dir / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client (sbatch, squeue, scontrol, scancel) needs in its environment."""
        return {"SLURM_CONF": str(self.conf)}

    def log(self, daemon: str) -> Path:
        return (self.munge_dir if daemon == "munged" else self.run_dir / "log") / f"{daemon}.log"

    # -- start / stop ---------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> SlurmCluster:
        started = time.monotonic()
        programs = {name: _require(name) for name in (*_DAEMONS, "sbatch", "scontrol", "sinfo")}
        self._layout()
        try:
            self._start_munge(programs["munged"])
            if self.net is not None:
                self.net.create()
            self._write_config()
            self._spawn("slurmctld", [programs["slurmctld"], "-D", "-i", "-f", str(self.conf)])
            for i, name in enumerate(self.node_names):
                slurmd = [programs["slurmd"], "-D", "-N", name, "-f", str(self.conf)]
                # Several slurmd cannot share one network namespace (one SlurmdPort each): each node
                # gets its own namespace and address on a bridge, as separate machines would.
                argv = slurmd if self.net is None else self.net.exec_argv(i, slurmd)
                self._spawn("slurmd" if i == 0 else f"slurmd-{name}", argv)
            self._wait_idle(programs["sinfo"], started + timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def _layout(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("etc", "state", "spool", "log", "dev", "jobcomp", *(f"spool/slurmd-{n}" for n in self.node_names)):
            (self.run_dir / sub).mkdir(exist_ok=True)
        for n in range(self.gpus):
            dev = self.run_dir / "dev" / f"nvidia{n}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(195, n))  # S_IFCHR

    def _start_munge(self, munged: str) -> None:
        munge_dir = self.munge_dir
        key = munge_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        uid, gid = pwd.getpwnam("munge").pw_uid, grp.getgrnam("munge").gr_gid
        for path in (munge_dir, key):
            os.chown(path, uid, gid)
        munge_dir.chmod(0o755)
        key.chmod(0o400)
        log = munge_dir / "munged.log"
        self._spawn(
            "munged",
            [
                munged,
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={log}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            user=uid,
            group=gid,
        )
        deadline = time.monotonic() + 15
        while not Path(self.munge_socket).exists():
            self._check_alive("munged")
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"munged did not create its socket:\n{self._tail('munged')}")
            time.sleep(0.05)

    @property
    def munge_socket(self) -> str:
        return str(self.munge_dir / "munge.socket")

    def _write_config(self) -> None:
        d = self.run_dir
        host = socket.gethostname().split(".")[0]
        ctld_addr = "127.0.0.1" if self.net is None else self.net.gateway
        gpus = f"{d}/dev/nvidia[0-{self.gpus - 1}]" if self.gpus > 1 else f"{d}/dev/nvidia0"
        lines = {
            "ClusterName": "flaretest",
            "SlurmctldHost": f"{host}({ctld_addr})",
            "SlurmctldPort": free_port(),
            "SlurmdPort": free_port(),
            "AuthType": "auth/munge",
            "AuthInfo": f"socket={self.munge_socket}",
            "CredType": "cred/munge",
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core_Memory",
            "DefMemPerCPU": 100,  # else a job without --mem takes the whole node's memory
            "SchedulerType": "sched/backfill",
            "SchedulerParameters": "sched_interval=1,bf_interval=1",
            "SlurmdParameters": "config_overrides",
            "GresTypes": "gpu",
            "MailProg": "/bin/true",
            "MpiDefault": "none",
            "ReturnToService": 2,
            "MinJobAge": 300,
            "KillWait": 3,
            "InactiveLimit": 0,
            "SlurmdTimeout": 300,
            "StateSaveLocation": d / "state",
            "SlurmdSpoolDir": d / "spool" / "slurmd-%n",
            "SlurmctldPidFile": d / "slurmctld.pid",
            "SlurmdPidFile": d / "slurmd-%n.pid",
            "SlurmctldLogFile": self.log("slurmctld"),
            "SlurmdLogFile": self.log("slurmd"),
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/filetxt",
            "JobCompLoc": d / "jobcomp" / "jobcomp.txt",
        }
        text = "".join(f"{k}={v}\n" for k, v in lines.items())
        for i, name in enumerate(self.node_names):
            addr = "127.0.0.1" if self.net is None else self.net.address(i)
            text += (
                f"NodeName={name} NodeAddr={addr} CPUs={self.cpus} RealMemory={MEMORY_MB} "
                f"Gres=gpu:{self.gpus} State=UNKNOWN\n"
            )
        nodes = ",".join(self.node_names)
        text += f"PartitionName={self.partition} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP\n"
        self.conf.write_text(text)
        (self.conf.parent / "gres.conf").write_text(
            "".join(f"NodeName={name} Name=gpu File={gpus}\n" for name in self.node_names)
        )

    def _spawn(self, name: str, argv: list[str], user: int | None = None, group: int | None = None) -> None:
        log = self.log(name).with_suffix(".out")
        with log.open("ab") as out:
            self.procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**_base_env(), **self.env},
                user=user,
                group=group,
                extra_groups=[] if user is not None else None,
            )

    def _tail(self, name: str, lines: int = 30) -> str:
        text = ""
        for path in (self.log(name), self.log(name).with_suffix(".out")):
            with contextlib.suppress(OSError):
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise SlurmClusterError(f"{name} exited with {proc.returncode}:\n{self._tail(name)}")

    def _wait_idle(self, sinfo: str, deadline: float) -> None:
        out = ""
        while time.monotonic() < deadline:
            for name in self.procs:
                self._check_alive(name)
            res = subprocess.run(
                [sinfo, "-h", "-N", "-o", "%N %t"], env={**_base_env(), **self.env}, capture_output=True, text=True
            )
            out = res.stdout.strip() + res.stderr.strip()
            states = [line.split()[-1] for line in res.stdout.splitlines() if line.strip()]
            if res.returncode == 0 and len(states) == len(self.node_names) and set(states) == {"idle"}:
                return
            time.sleep(0.2)
        raise SlurmClusterError(
            f"the node did not become idle (sinfo: {out!r}):\n{self._tail('slurmctld')}\n{self._tail('slurmd')}"
        )

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        res = subprocess.run(list(argv), env={**_base_env(), **self.env}, capture_output=True, text=True, timeout=30)
        if check and res.returncode != 0:
            raise SlurmClusterError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def jobs(self) -> list[str]:
        """``<id> <name> <state>`` of every job the controller still lists as pending or running."""
        out = self.run("squeue", "-h", "-o", "%i %j %T").stdout
        return [line for line in out.splitlines() if line.strip()]

    def settled_jobs(self, timeout: float = 10.0) -> list[str]:
        """:meth:`jobs` once the queue is empty or ``timeout`` passed (a cancelled job is listed
        while its steps end, up to KillWait)."""
        deadline = time.monotonic() + timeout
        while (left := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def cancel_all(self, timeout: float = 20.0) -> None:
        ids = [line.split()[0] for line in self.jobs()]
        if not ids:
            return
        self.run("scancel", *ids, check=False)
        deadline = time.monotonic() + timeout
        while self.jobs() and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel every job, end slurmd, slurmctld, munged (each whole process group); raise if
        anything of the cluster survives."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(SlurmClusterError, subprocess.TimeoutExpired):
                self.cancel_all()
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # what the daemon left in its group (job steps)
        left = _cluster_processes(self.conf, self.munge_socket)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.procs.clear()
        shutil.rmtree(self.munge_dir, ignore_errors=True)
        if self.net is not None:
            self.net.delete()
        if left:
            raise SlurmClusterError(f"processes of the cluster were left running: {left}")


class NodeNetwork:
    """One network namespace per node on a private bridge: ``10.X.Y.1`` (this host: slurmctld,
    clients) and ``10.X.Y.(10 + i)`` (node i). Names and subnet are random per cluster; nothing
    but the cluster's own daemons and jobs uses them, and :meth:`delete` removes them all."""

    def __init__(self, nodes: int) -> None:
        tag = secrets.token_hex(3)
        self.nodes = nodes
        self.bridge = f"flbr{tag}"
        self.namespaces = [f"flare-{tag}-{i}" for i in range(nodes)]
        rnd = secrets.randbelow(200 * 250)
        self.prefix = f"10.{20 + rnd // 250}.{rnd % 250}"
        self.gateway = f"{self.prefix}.1"

    def address(self, i: int) -> str:
        return f"{self.prefix}.{10 + i}"

    def _ip(self, *args: str) -> None:
        res = subprocess.run(["ip", *args], capture_output=True, text=True)
        if res.returncode != 0:
            raise SlurmClusterError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")

    def create(self) -> None:
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            host_end, node_end = f"{self.bridge}v{i}", f"{self.bridge}p{i}"
            self._ip("netns", "add", ns)
            self._ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
            self._ip("link", "set", host_end, "master", self.bridge)
            self._ip("link", "set", host_end, "up")
            self._ip("link", "set", node_end, "netns", ns)
            self._ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", node_end)
            self._ip("-n", ns, "link", "set", node_end, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "route", "add", "default", "via", self.gateway)

    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        # nsenter, not `ip netns exec`: that also remounts /sys, hiding the cgroup mount slurmd reads.
        return ["nsenter", f"--net=/var/run/netns/{self.namespaces[i]}", "--", *argv]

    def delete(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _base_env() -> Mapping[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "AIRFLOW"))}


def _cluster_processes(conf: Path, munge_socket: str) -> list[int]:
    """This cluster's daemons (their command line names its config or munge socket) and job step
    daemons (slurmstepd inherits slurmd's ``SLURM_CONF``)."""
    markers = (str(conf).encode() + b"\0", munge_socket.encode() + b"\0")
    env_marker = f"SLURM_CONF={conf}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            daemon = any(m in cmdline for m in markers) and any(d.encode() in cmdline for d in _DAEMONS)
            step = cmdline.startswith(b"slurmstepd") and env_marker in Path(f"/proc/{entry}/environ").read_bytes()
            if daemon or step:
                found.append(int(entry))
    return found
