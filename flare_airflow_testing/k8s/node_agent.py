"""LOCAL NODE AGENT — a test harness that plays the kubelet for one simulated Node.

Not a kubelet and not part of flare_airflow: it exists so tests can run real pods against a real
control plane (:mod:`flare_airflow_testing.k8s.control_plane`) on a machine without a container runtime.
Everything goes through the real Kubernetes API with the ``kubernetes`` Python client:

* **Node**: registers ``node_name`` with InternalIP 127.0.0.1, the kubelet port (the HTTPS port this
  agent serves), capacity = allocatable (default cpu 8, memory 32Gi, pods 110, nvidia.com/gpu 4),
  a Ready condition, and removes the ``node.kubernetes.io/not-ready`` taint the apiserver's admission
  adds. Resource accounting is the real scheduler's job (pods stay Pending "Insufficient …"); the
  agent only runs what gets bound to it.
* **Pods** bound to the node (watch on ``spec.nodeName``): every container runs its
  ``command + args`` (with ``$(VAR)`` expansion, as a kubelet does) as a LOCAL PROCESS — an argv list,
  never a shell — in its own process group, with the container's env: plain values, ``valueFrom``
  ``secretKeyRef`` / ``configMapKeyRef`` (read through the API, as a kubelet would),
  ``fieldRef`` (metadata.name/namespace/uid/labels/annotations, spec.nodeName,
  spec.serviceAccountName, status.podIP/hostIP), ``resourceFieldRef`` and ``envFrom``. A container
  without ``command`` uses ``image_entrypoints[image]`` (default: none) before its args.
  The process env is NOT the agent's: it is ``base_env`` + ``HOSTNAME`` +
  ``KUBERNETES_SERVICE_HOST/PORT`` (the real apiserver) + the pod's env. ``base_env`` defaults to
  what an image built for this host carries: PATH, HOME, LANG, LC_ALL, TZ of the agent and the
  host's CPU-kernel settings of the numeric libraries (``OPENBLAS_*``, ``MKL_*``, ``OMP_*``, e.g.
  ``OPENBLAS_CORETYPE`` on AMD EPYC machines, where older OpenBLAS builds misbehave). Without them a
  pod's trainer would pick another BLAS kernel than a process site on the same host and compute
  float32 results that differ in the last bit.
* **Volumes → local paths**: hostPath → the same path; emptyDir → a per-pod directory; PVC →
  ``pvc_paths[claimName]`` when configured, otherwise the bound PV's ``hostPath``/``local`` path
  (read through the API); secret / configMap / downwardAPI → files written to a per-pod directory.
  A process cannot see a mountPath, so the mapping is applied by REWRITING STRINGS: in the command,
  args, env values and workingDir, every occurrence of a mountPath at a path boundary (start of the
  string, or after ``=``, ``:``, ``,``, whitespace, a quote, or ``file://``) is replaced by its local
  path (longest mountPath first). ``subPath`` is honoured: the mountPath maps to that directory of
  the volume, created when missing as a kubelet does. An ``emptyDir`` mounted at /tmp (the pod's
  scratch under a read-only root filesystem) is the host's /tmp, left unmapped: tests pass paths
  under /tmp (pytest's ``tmp_path``) in argv and env, and a process shares the host's filesystem
  anyway. ``readOnly`` mounts and ``readOnlyRootFilesystem`` are not enforced (processes run as the
  agent's user). Paths inside files are not rewritten. The mapping is also given to the process as
  JSON in ``FLARE_NODE_AGENT_MOUNTS``. The working directory is the rewritten ``workingDir`` when it
  exists locally, else a per-pod scratch directory.
* **Status** through ``pods/status``: Pending with waiting reasons, Running (container ``running``
  state, startedAt, podIP 127.0.0.1), then Succeeded/Failed with each container's exit code and
  reason (``Completed``, ``Error``, ``OOMKilled`` when the process died of SIGKILL — also when the
  agent enforces ``limits.memory`` on the process group's RSS —, ``StartError`` when the argv cannot
  be executed). ``restartPolicy`` Always/OnFailure restarts with a ``CrashLoopBackOff`` wait. When the
  first process of a container exits, the rest of its process group is killed (as a container's).
* **Logs**: stdout/stderr of each container go to a per-container file (CRI format, one timestamp per
  line) and are served at the kubelet endpoint ``GET /containerLogs/{ns}/{pod}/{container}`` over
  HTTPS (self-signed) with ``follow``, ``tailLines``, ``timestamps``, ``limitBytes``,
  ``sinceSeconds``, ``sinceTime`` and ``previous``, so log reads go client → apiserver → agent.
* **Deletion**: when a pod gets a deletionTimestamp, SIGTERM its process groups, SIGKILL after the
  grace period, then delete the pod with grace 0 and a UID precondition (as a kubelet confirms a
  deletion) — also for pods that never started.
* **Fault injection** by image name (markers configurable in :class:`Faults`): ``pull-error`` →
  Pending, ErrImagePull then ImagePullBackOff (never runs); ``invalid-image`` → InvalidImageName;
  ``create-config-error`` → CreateContainerConfigError. A missing Secret/ConfigMap (or key) gives
  CreateContainerConfigError with the kubelet's message (retried, so creating it later lets the pod
  start); an unresolvable volume gives ContainerCreating plus a ``FailedMount`` event.
  Events (Started, Killing, Failed, BackOff, FailedMount …) are recorded like a kubelet's.

* **Pod network and DNS (stand-in)**: a pod with ``hostname`` and ``subdomain`` (a headless
  Service's member, e.g. a multi-node site job's pod) gets a network namespace and address of its
  own on a private bridge and sees a hosts file with the records a cluster DNS would serve
  (:class:`PodNetwork`, :meth:`NodeAgent.refresh_dns`); other pods share the host network.

Not simulated: exec/attach/port-forward, probes, securityContext (processes run as the agent's
user), image pulls, cgroups other than the memory check.

Use :class:`NodeAgent` (``start()`` / ``stop()``, background threads) from a fixture, or
``python -m flare_airflow_testing.k8s.node_agent --kubeconfig …`` in a terminal.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import datetime as dt
import http.server
import json
import logging
import math
import os
import pathlib
import re
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from kubernetes.utils import parse_quantity
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger("flare.node_agent")

DEFAULT_CAPACITY = {
    "cpu": "8",
    "memory": "32Gi",
    "pods": "110",
    "nvidia.com/gpu": "4",
    "ephemeral-storage": "100Gi",
}
SMP = "application/strategic-merge-patch+json"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
AGENT_VERSION = "flare-node-agent://0.1"


@dataclass
class Faults:
    """Image-name markers the agent turns into kubelet failure states (substring match)."""

    pull_error: str = "pull-error"
    invalid_image: str = "invalid-image"
    create_config_error: str = "create-config-error"
    create_config_error_message: str = 'secret "injected-by-node-agent" not found'
    # ErrImagePull is reported first, ImagePullBackOff this many seconds later.
    image_pull_backoff_after: float = 1.0
    crashloop_backoff: float = 1.0  # first CrashLoopBackOff wait (doubles, capped at 10x)


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _nano_ts(t: float) -> str:
    d = dt.datetime.fromtimestamp(t, dt.UTC)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond:06d}000Z"


def _parse_ts(s: str) -> float:
    s = s.rstrip("Z")
    if "." in s:
        base, frac = s.split(".", 1)
        frac = (frac + "000000")[:6]
        s = f"{base}.{frac}"
        fmt = "%Y-%m-%dT%H:%M:%S.%f"
    else:
        fmt = "%Y-%m-%dT%H:%M:%S"
    return dt.datetime.strptime(s, fmt).replace(tzinfo=dt.UTC).timestamp()


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


_HOST_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")
_HOST_KERNEL_ENV_PREFIXES = ("OPENBLAS_", "MKL_", "OMP_")


def host_image_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment an image built for this host would carry (see the module docstring)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k in _HOST_ENV or k.startswith(_HOST_KERNEL_ENV_PREFIXES)}


def expand_vars(value: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: defined vars are substituted, ``$$`` escapes, others stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR_REF.sub(sub, value)


class MountMap:
    """mountPath → local path, applied to strings (see the module docstring)."""

    def __init__(self, mounts: dict[str, str]) -> None:
        self.mounts = {m.rstrip("/") or "/": p for m, p in mounts.items()}
        paths = sorted((m for m in self.mounts if m != "/"), key=len, reverse=True)
        self._re = (
            re.compile(
                r"(?:^|(?<=file://)|(?<=[=:,\s\"']))(" + "|".join(re.escape(m) for m in paths) + r")(?=$|[/\s\"',;:])"
            )
            if paths
            else None
        )

    def rewrite(self, s: str) -> str:
        if self._re is None:
            return s
        return self._re.sub(lambda m: self.mounts[m.group(1)], s)


class _ConfigError(Exception):
    """CreateContainerConfigError (message as a kubelet gives it)."""


class _MountError(Exception):
    """A volume could not be set up (FailedMount)."""


# ----------------------------------------------------------------------------- containers
class _Container:
    """One container of a pod: its process(es) over restarts, its status and its log files."""

    def __init__(self, run: _PodRun, spec: dict[str, Any], init: bool) -> None:
        self.run = run
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.restart_count = 0
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.readers: list[threading.Thread] = []
        self.log_lock = threading.Lock()
        self.killed_by_agent = False
        self.oom = False
        self.container_id = ""

    def log_path(self, instance: int | None = None) -> pathlib.Path:
        n = self.restart_count if instance is None else instance
        return self.run.dir / "logs" / f"{self.name}-{n}.log"

    @property
    def terminated(self) -> bool:
        return "terminated" in self.state

    @property
    def running(self) -> bool:
        return "running" in self.state

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": f"{AGENT_VERSION}/{self.spec.get('image', '')}" if self.container_id else "",
            "ready": self.running,
            "restartCount": self.restart_count,
            "started": self.running,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            st["containerID"] = self.container_id
        return st

    def write_log(self, stream: str, data: bytes) -> None:
        partial = not data.endswith(b"\n")
        content = data[:-1] if not partial else data
        line = f"{_nano_ts(time.time())} {stream} {'P' if partial else 'F'} ".encode() + content + b"\n"
        with self.log_lock, open(self.log_path(), "ab") as f:
            f.write(line)


# ----------------------------------------------------------------------------- pods
class _PodRun:
    def __init__(self, agent: NodeAgent, pod: dict[str, Any]) -> None:
        self.agent = agent
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.name: str = meta["name"]
        self.dir = agent.work_dir / "pods" / f"{self.ns}_{self.name}_{self.uid}"
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        spec = pod["spec"]
        self.init_containers = [_Container(self, c, True) for c in spec.get("initContainers") or []]
        self.containers = [_Container(self, c, False) for c in spec.get("containers") or []]
        self.restart_policy = spec.get("restartPolicy", "Always")
        self.lock = threading.RLock()
        self.deleting = threading.Event()
        self.gone = threading.Event()  # the pod object is deleted
        self.done = threading.Event()  # the lifecycle thread finished
        self.phase = "Pending"
        self.start_time = now_rfc3339()
        self.ready_since: str | None = None
        self.initialized = not self.init_containers
        self._last_status: str = ""
        self.pod_ip = "127.0.0.1"
        # (network namespace, address) when the pod has a network of its own (see PodNetwork)
        self.net: tuple[str, str] | None = None
        self.thread = threading.Thread(target=self._lifecycle, name=f"pod-{self.ns}/{self.name}", daemon=True)
        self._delete_thread: threading.Thread | None = None

    # ---------------------------------------------------------------- helpers
    def container(self, name: str) -> _Container | None:
        for c in self.containers + self.init_containers:
            if c.name == name:
                return c
        return None

    def _wait(self, seconds: float) -> bool:
        """Sleep unless the pod is being deleted; True when it is."""
        return self.deleting.wait(seconds)

    def event(self, reason: str, message: str, kind: str = "Normal", container: _Container | None = None) -> None:
        self.agent.record_event(self.pod, reason, message, kind, container)

    # ---------------------------------------------------------------- status
    def patch_status(self, force: bool = False) -> None:
        with self.lock:
            if self.gone.is_set():
                return
            containers = [c.status() for c in self.containers]
            all_ready = bool(self.containers) and all(c.running for c in self.containers)
            ts = now_rfc3339()
            if self.phase in ("Succeeded", "Failed"):
                ready_reason: dict[str, Any] = {"reason": "PodCompleted"}
            elif not all_ready:
                not_ready = [c.name for c in self.containers if not c.running]
                ready_reason = {
                    "reason": "ContainersNotReady",
                    "message": f"containers with unready status: [{' '.join(not_ready)}]",
                }
            else:
                ready_reason = {}
            ready = "True" if all_ready and self.phase == "Running" else "False"
            conds = [
                {"type": "Initialized", "status": "True" if self.initialized else "False", "lastTransitionTime": ts},
                {
                    "type": "Ready",
                    "status": ready,
                    "lastTransitionTime": ts,
                    **({} if ready == "True" else ready_reason),
                },
                {
                    "type": "ContainersReady",
                    "status": ready,
                    "lastTransitionTime": ts,
                    **({} if ready == "True" else ready_reason),
                },
            ]
            status: dict[str, Any] = {
                "phase": self.phase,
                "hostIP": "127.0.0.1",
                "startTime": self.start_time,
                "conditions": conds,
                "containerStatuses": containers,
            }
            if self.init_containers:
                status["initContainerStatuses"] = [c.status() for c in self.init_containers]
            if self.phase != "Pending" or any(c.container_id for c in self.containers):
                status["podIP"] = self.pod_ip
                status["podIPs"] = [{"ip": self.pod_ip}]
            key = json.dumps({k: v for k, v in status.items() if k != "conditions"}, sort_keys=True)
            if key == self._last_status and not force:
                return
            self._last_status = key
        try:
            self.agent.core.patch_namespaced_pod_status(
                self.name, self.ns, {"status": status}, _content_type=SMP, _preload_content=False
            )
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("status patch for %s/%s failed: %s", self.ns, self.name, e)

    def set_waiting(self, containers: list[_Container], reason: str, message: str | None = None) -> None:
        with self.lock:
            for c in containers:
                c.state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        self.patch_status()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self.thread.start()

    def _lifecycle(self) -> None:
        try:
            self._run()
        except Exception:
            log.error("node agent: pod %s/%s failed in the agent:\n%s", self.ns, self.name, traceback.format_exc())
        finally:
            self.done.set()

    def _run(self) -> None:
        agent, faults = self.agent, self.agent.faults
        everything = self.init_containers + self.containers
        self.set_waiting(everything, "ContainerCreating")
        # 1. injected image faults (never run)
        for c in everything:
            image = c.spec.get("image", "")
            if faults.pull_error and faults.pull_error in image:
                msg = (
                    f'rpc error: code = Unknown desc = failed to pull and unpack image "{image}": '
                    f'failed to resolve reference "{image}": pull access denied, repository does not exist '
                    "or may require authorization (injected by the node agent)"
                )
                self.event("Pulling", f'Pulling image "{image}"', container=c)
                self.set_waiting([c], "ErrImagePull", msg)
                self.event("Failed", f'Failed to pull image "{image}": {msg}', "Warning", c)
                self.event("Failed", "Error: ErrImagePull", "Warning", c)
                if self._wait(faults.image_pull_backoff_after):
                    return
                self.set_waiting([c], "ImagePullBackOff", f'Back-off pulling image "{image}"')
                self.event("BackOff", f'Back-off pulling image "{image}"', container=c)
                self.event("Failed", "Error: ImagePullBackOff", "Warning", c)
                self.deleting.wait()
                return
            if faults.invalid_image and faults.invalid_image in image:
                msg = f'Failed to apply default image tag "{image}": couldn\'t parse image reference "{image}"'
                self.set_waiting([c], "InvalidImageName", msg)
                self.event("InspectFailed", msg, "Warning", c)
                self.event("Failed", "Error: InvalidImageName", "Warning", c)
                self.deleting.wait()
                return
            if faults.create_config_error and faults.create_config_error in image:
                self.set_waiting([c], "CreateContainerConfigError", faults.create_config_error_message)
                self.event("Failed", f"Error: {faults.create_config_error_message}", "Warning", c)
                self.deleting.wait()
                return
        # 2. volumes (retried like the kubelet's volume manager)
        reported = ""
        while True:
            try:
                volumes = agent.resolve_volumes(self)
                break
            except _MountError as e:
                if str(e) != reported:
                    reported = str(e)
                    self.event("FailedMount", str(e), "Warning")
                if self._wait(agent.config_retry_seconds):
                    return
        # 3. a network of its own for a pod that others find by name (hostname + subdomain)
        if self.agent.wants_network(self.pod):
            self.net = self.agent.network.attach()
            self.pod_ip = self.net[1]
            self.agent.refresh_dns(self.ns)
        # 4. init containers, in order, then the containers together
        for c in self.init_containers:
            if not self._run_init(c, volumes):
                return
        with self.lock:
            self.initialized = True
        supervisors = [
            threading.Thread(target=self._supervise, args=(c, volumes), daemon=True, name=f"ctr-{self.name}/{c.name}")
            for c in self.containers
        ]
        for t in supervisors:
            t.start()
        for t in supervisors:
            t.join()
        if self.deleting.is_set():
            return
        with self.lock:
            self._set_final_phase()
        self.patch_status()  # usually a no-op: the last container's exit already reported it
        self.release_network()

    def vanish(self) -> None:
        """The pod object is gone (deleted with grace 0 by someone else): end everything of it."""
        self.kill_all(0)
        self.done.wait(timeout=10)
        self.release_network()

    def release_network(self) -> None:
        """Give the pod's network namespace and address back (its processes are gone)."""
        with self.lock:
            net, self.net = self.net, None
        if net is not None:
            self.agent.network.release(*net)
            self.agent.refresh_dns(self.ns)

    def _prepare(self, c: _Container, volumes: dict[str, str]) -> tuple[list[str], dict[str, str], str] | None:
        """argv, env, cwd; None when the pod is deleted while waiting for its configuration."""
        reported = ""
        while True:
            try:
                return self.agent.container_config(self, c, volumes)
            except _ConfigError as e:
                if str(e) != reported:
                    reported = str(e)
                    self.set_waiting([c], "CreateContainerConfigError", str(e))
                    self.event("Failed", f"Error: {e}", "Warning", c)
                if self._wait(self.agent.config_retry_seconds):
                    return None

    def _run_init(self, c: _Container, volumes: dict[str, str]) -> bool:
        while True:
            cfg = self._prepare(c, volumes)
            if cfg is None:
                return False
            self._execute(c, *cfg)
            if self.deleting.is_set():
                return False
            if c.state["terminated"]["exitCode"] == 0:
                return True
            if self.restart_policy == "Never":
                with self.lock:
                    self.phase = "Failed"
                    for other in self.containers:
                        other.state = {"waiting": {"reason": "PodInitializing"}}
                self.patch_status()
                return False
            if self._backoff(c):
                return False

    def _supervise(self, c: _Container, volumes: dict[str, str]) -> None:
        while True:
            cfg = self._prepare(c, volumes)
            if cfg is None:
                return
            self._execute(c, *cfg)
            if self.deleting.is_set():
                return
            code = c.state["terminated"]["exitCode"]
            if self.restart_policy == "Never" or (self.restart_policy == "OnFailure" and code == 0):
                return
            if self._backoff(c):
                return

    def _backoff(self, c: _Container) -> bool:
        """CrashLoopBackOff before a restart; True when the pod is deleted meanwhile."""
        wait = min(self.agent.faults.crashloop_backoff * (2**c.restart_count), self.agent.faults.crashloop_backoff * 10)
        with self.lock:
            c.last_state = {"terminated": c.state["terminated"]}
            c.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {wait:g}s restarting failed container={c.name} "
                    f"pod={self.name}_{self.ns}({self.uid})",
                }
            }
            c.restart_count += 1
        self.patch_status()
        self.event("BackOff", "Back-off restarting failed container", "Warning", c)
        return self._wait(wait)

    def _execute(self, c: _Container, argv: list[str], env: dict[str, str], cwd: str) -> None:
        """Run one instance of the container to completion; leaves ``c.state`` terminated."""
        started = now_rfc3339()
        with self.lock:
            if self.deleting.is_set():
                c.state = {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": started}}
                return
            c.killed_by_agent = c.oom = False
            if self.net is not None:
                argv = self.agent.network.exec_argv(self.net[0], self.agent.hosts_file(self.ns), argv)
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as e:
                msg = f"failed to create containerd task: exec: {argv[0] if argv else ''!r}: {e.strerror or e}"
                c.container_id = f"{AGENT_VERSION}/{uuid.uuid4().hex}"
                c.state = {
                    "terminated": {
                        "exitCode": 128,
                        "reason": "StartError",
                        "message": msg,
                        "startedAt": started,
                        "finishedAt": now_rfc3339(),
                        "containerID": c.container_id,
                    }
                }
                self.patch_status()
                self.event("Failed", f"Error: {msg}", "Warning", c)
                return
            c.proc = proc
            c.container_id = f"{AGENT_VERSION}/{proc.pid}-{uuid.uuid4().hex[:12]}"
            c.state = {"running": {"startedAt": started}}
            if not c.init:
                self.phase = "Running"
            self.agent.track(proc)
            c.readers = [
                threading.Thread(target=_pump, args=(proc.stdout, c, "stdout"), daemon=True),
                threading.Thread(target=_pump, args=(proc.stderr, c, "stderr"), daemon=True),
            ]
            for t in c.readers:
                t.start()
        self.patch_status()
        self.event("Started", f"Started container {c.name}", container=c)
        limit = _memory_limit(c.spec)
        while True:
            try:
                rc = proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                if limit and _group_rss(proc.pid) > limit:
                    c.oom = True
                    _killpg(proc.pid, signal.SIGKILL)
        # The container's first process is gone: the rest of its group goes with it.
        _killpg(proc.pid, signal.SIGKILL)
        for t in c.readers:
            t.join(timeout=5)
        self.agent.untrack(proc)
        if rc >= 0:
            code, reason = rc, ("Completed" if rc == 0 else "Error")
        else:
            sig = -rc
            code = 128 + sig
            reason = "OOMKilled" if sig == signal.SIGKILL and (c.oom or not c.killed_by_agent) else "Error"
        with self.lock:
            c.proc = None
            c.state = {
                "terminated": {
                    "exitCode": code,
                    "reason": reason,
                    "startedAt": started,
                    "finishedAt": now_rfc3339(),
                    "containerID": c.container_id,
                }
            }
        if not self.deleting.is_set():
            with self.lock:
                if not c.init and self._all_done():
                    self._set_final_phase()
            self.patch_status()  # one patch: the container's termination and, when last, the pod's phase

    def _all_done(self) -> bool:
        """Every app container terminated and none will be restarted."""
        for c in self.containers:
            if not c.terminated:
                return False
            code = c.state["terminated"].get("exitCode", 1)
            if self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0):
                return False
        return True

    def _set_final_phase(self) -> None:
        failed = any(c.state.get("terminated", {}).get("exitCode", 1) != 0 for c in self.containers)
        self.phase = "Failed" if failed else "Succeeded"

    # ---------------------------------------------------------------- deletion
    def request_delete(self, grace: int | None) -> None:
        with self.lock:
            if self._delete_thread is not None:
                return
            self.deleting.set()
            self._delete_thread = threading.Thread(
                target=self._delete, args=(30 if grace is None else grace,), daemon=True, name=f"del-{self.name}"
            )
            self._delete_thread.start()

    def kill_all(self, grace: float) -> None:
        """SIGTERM every running process group of the pod, SIGKILL after ``grace`` seconds."""
        procs = []
        with self.lock:
            for c in self.init_containers + self.containers:
                if c.proc is not None and c.proc.poll() is None:
                    c.killed_by_agent = True
                    procs.append(c.proc)
        if not procs:
            return
        for p in procs:
            _killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        for p in procs:
            _killpg(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    def _delete(self, grace: int) -> None:
        running = any(c.running for c in self.init_containers + self.containers)
        if running:
            self.event("Killing", "Stopping container " + ", ".join(c.name for c in self.containers if c.running))
        self.kill_all(grace)
        self.done.wait(timeout=10)
        self.release_network()
        self.agent.confirm_delete(self.ns, self.name, self.uid)


def _pump(stream: Any, c: _Container, name: str) -> None:
    try:
        for line in iter(stream.readline, b""):
            c.write_log(name, line)
    except (OSError, ValueError):
        pass
    finally:
        with contextlib.suppress(OSError):
            stream.close()


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _memory_limit(spec: dict[str, Any]) -> int | None:
    limit = ((spec.get("resources") or {}).get("limits") or {}).get("memory")
    return int(parse_quantity(limit)) if limit else None


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _group_rss(pgid: int) -> int:
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = pathlib.Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # fields[0] is state (field 3): pgrp is field 5, rss (pages) field 24
        if int(fields[2]) == pgid:
            total += int(fields[21]) * _PAGE
    return total


# ----------------------------------------------------------------------------- log server
class _LogHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _LogServer

    def setup(self) -> None:
        self.request.settimeout(30)
        self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("kubelet endpoint: " + format, *args)

    def _send(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        if parts == ["healthz"]:
            return self._send(200, "ok")
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._send(404, f"404 page not found: {url.path}")
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        self.server.agent.serve_logs(self, parts[1], parts[2], parts[3], q)
        return None


class _LogServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, agent: NodeAgent, ctx: ssl.SSLContext) -> None:
        self.agent = agent
        super().__init__(("127.0.0.1", 0), _LogHandler)
        self.socket = ctx.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)


# ----------------------------------------------------------------------------- pod network
class PodNetwork:
    """THE HARNESS'S STAND-IN FOR A POD NETWORK AND CLUSTER DNS (not a CNI plugin, not CoreDNS).

    Pods that others find by name (``hostname`` + ``subdomain``: the pods of a multi-node site
    job) each get a network namespace of their own on a private bridge: ``10.X.Y.1`` on this host,
    ``10.X.Y.(10 + n)`` for pod n (reported as its podIP), so that two pods of a group are two hosts
    with their own ports, as on a cluster. Their processes run under ``nsenter --net`` and
    ``unshare --mount`` with the namespace's hosts file (:meth:`NodeAgent.refresh_dns`) bind-mounted
    over /etc/hosts: the names a cluster DNS would serve resolve there. Every other pod keeps the
    host network (podIP 127.0.0.1), as before. Names and subnet are random per agent; :meth:`close`
    removes them.
    """

    _HOSTS_WRAPPER = 'mount --bind "$0" /etc/hosts && exec "$@"'

    def __init__(self, dns_dir: pathlib.Path) -> None:
        tag = secrets.token_hex(3)
        self.dns_dir = dns_dir
        self.bridge = f"fk{tag}"
        rnd = secrets.randbelow(200 * 250)
        self.prefix = f"10.{20 + rnd // 250}.{rnd % 250}"
        self.gateway = f"{self.prefix}.1"
        self._tag = tag
        self._free = list(range(10, 250))
        self._made = False
        self._lock = threading.Lock()

    @staticmethod
    def _ip(*args: str) -> None:
        res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"node agent: ip {' '.join(args)} failed: {res.stderr.strip()}")

    def attach(self) -> tuple[str, str]:
        """A new network namespace with its own address on the bridge: ``(namespace, address)``."""
        with self._lock:
            if not self._made:
                self._ip("link", "add", self.bridge, "type", "bridge")
                self._made = True
                self._ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
                self._ip("link", "set", self.bridge, "up")
            if not self._free:
                raise RuntimeError("node agent: no pod address left on the harness bridge")
            n = self._free.pop(0)
        ns, host_end, pod_end = f"{self.bridge}-{n}", f"{self.bridge}h{n}", f"{self.bridge}p{n}"
        address = f"{self.prefix}.{n}"
        self._ip("netns", "add", ns)
        self._ip("link", "add", host_end, "type", "veth", "peer", "name", pod_end)
        self._ip("link", "set", host_end, "master", self.bridge)
        self._ip("link", "set", host_end, "up")
        self._ip("link", "set", pod_end, "netns", ns)
        self._ip("-n", ns, "addr", "add", f"{address}/24", "dev", pod_end)
        self._ip("-n", ns, "link", "set", pod_end, "up")
        self._ip("-n", ns, "link", "set", "lo", "up")
        self._ip("-n", ns, "route", "add", "default", "via", self.gateway)
        return ns, address

    def release(self, ns: str, address: str) -> None:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # its veth goes with it
        with self._lock:
            self._free.append(int(address.rsplit(".", 1)[1]))

    def exec_argv(self, ns: str, hosts_file: str, argv: list[str]) -> list[str]:
        # Fixed text; the pod's argv follows as "$@" (never parsed by the shell). nsenter and unshare
        # exec (no fork): the container's process keeps its pid and process group.
        return [
            "nsenter", f"--net=/var/run/netns/{ns}", "--",
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", self._HOSTS_WRAPPER, hosts_file, *argv,
        ]  # fmt: skip

    def close(self) -> None:
        with self._lock:
            made, self._made = self._made, False
        if made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


# ----------------------------------------------------------------------------- the agent
class NodeAgent:
    """The local node agent (see the module docstring). ``start()`` returns once the node is Ready."""

    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        *,
        kubeconfig: str | os.PathLike[str] | None = None,
        node_name: str = "flare-node-1",
        work_dir: str | os.PathLike[str] | None = None,
        capacity: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        pvc_paths: dict[str, str] | None = None,
        faults: Faults | None = None,
        base_env: dict[str, str] | None = None,
        image_entrypoints: dict[str, list[str]] | None = None,
        config_retry_seconds: float = 2.0,
        record_events: bool = True,
        delete_node_on_stop: bool = True,
    ) -> None:
        if api_client is None:
            cfg = k8s.Configuration()
            k8s_config.load_kube_config(config_file=str(kubeconfig) if kubeconfig else None, client_configuration=cfg)
            cfg.connection_pool_maxsize = 64
            api_client = k8s.ApiClient(cfg)
        api_client.user_agent = "flare-node-agent/0.1 (test harness; kubelet/v1.20.2)"
        self.api = api_client
        self.core = k8s.CoreV1Api(api_client)
        self.node_name = node_name
        self.work_dir = pathlib.Path(work_dir or tempfile.mkdtemp(prefix=f"{node_name}-")).resolve()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.capacity = dict(DEFAULT_CAPACITY if capacity is None else capacity)
        self.labels = dict(labels or {})
        self.pvc_paths = dict(pvc_paths or {})
        self.faults = faults or Faults()
        self.base_env = dict(base_env) if base_env is not None else host_image_env()
        self.image_entrypoints = dict(image_entrypoints or {})
        self.config_retry_seconds = config_retry_seconds
        self.record_events = record_events
        self.delete_node_on_stop = delete_node_on_stop
        host = urllib.parse.urlsplit(api_client.configuration.host)
        self.api_host, self.api_port = host.hostname or "127.0.0.1", host.port or 443
        self.port = 0
        self._runs: dict[str, _PodRun] = {}
        self._by_name: dict[tuple[str, str], _PodRun] = {}
        self._confirming: set[str] = set()
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watch_resp: Any = None
        self._watch_thread: threading.Thread | None = None
        self._server: _LogServer | None = None
        self._server_thread: threading.Thread | None = None
        self._synced = threading.Event()
        self.errors: list[str] = []
        self.network = PodNetwork(self.work_dir / "dns")
        self._dns_lock = threading.Lock()

    # ---------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30.0) -> NodeAgent:
        self._start_log_server()
        self._register_node()
        self._watch_thread = threading.Thread(target=self._watch_loop, name=f"{self.node_name}-watch", daemon=True)
        self._watch_thread.start()
        atexit.register(self._kill_everything)
        if not self._synced.wait(timeout):
            raise RuntimeError("node agent: the pod watch did not sync")
        return self

    def stop(self, grace: float = 2.0) -> None:
        """Stop watching, kill every process the agent started, stop serving logs, delete the Node."""
        self._stop.set()
        resp = self._watch_resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.deleting.set()
        killers = [threading.Thread(target=r.kill_all, args=(grace,), daemon=True) for r in runs]
        for t in killers:
            t.start()
        for t in killers:
            t.join(timeout=grace + 10)
        for run in runs:
            run.done.wait(timeout=10)
        self._kill_everything()
        for run in runs:
            run.release_network()
        self.network.close()
        if self._watch_thread:
            self._watch_thread.join(timeout=10)
        if self._server:
            self._server.shutdown()
            self._server.server_close()
        if self.delete_node_on_stop:
            with contextlib.suppress(ApiException):
                self.core.delete_node(self.node_name, grace_period_seconds=0, _preload_content=False)
        atexit.unregister(self._kill_everything)

    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def running_processes(self) -> list[int]:
        """PIDs of container processes currently alive (for tests)."""
        with self._lock:
            return [p.pid for p in self._procs if p.poll() is None]

    def track(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs.add(proc)

    def untrack(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs.discard(proc)

    def _kill_everything(self) -> None:
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            _killpg(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    # ---------------------------------------------------------------- pod network and DNS
    @staticmethod
    def wants_network(pod: dict[str, Any]) -> bool:
        """A pod other pods find by name (``hostname`` + ``subdomain``, a headless Service's member)."""
        spec = pod.get("spec") or {}
        return bool(spec.get("hostname") and spec.get("subdomain"))

    def hosts_file(self, ns: str) -> str:
        """The hosts file pods with a network of their own in ``ns`` see as /etc/hosts."""
        path = self.network.dns_dir / f"{ns}.hosts"
        if not path.exists():
            self.network.dns_dir.mkdir(parents=True, exist_ok=True)
            path.write_text("127.0.0.1\tlocalhost\n")
        return str(path)

    def _headless_selector(self, ns: str, name: str) -> dict[str, str] | None:
        try:
            svc = json.loads(self.core.read_namespaced_service(name, ns, _preload_content=False).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        spec = svc.get("spec") or {}
        if spec.get("clusterIP") != "None" or not spec.get("selector"):
            return None
        return dict(spec["selector"])

    def refresh_dns(self, ns: str) -> None:
        """Rewrite ``ns``'s hosts file IN PLACE (pods bind-mount its inode) with the records a cluster
        DNS serves for pods with hostname + subdomain: ``<hostname>.<subdomain>[.<ns>[.svc[.cluster.local]]]``
        for each such pod of this node that has an address, when a headless Service named
        ``<subdomain>`` exists in ``ns`` and selects the pod (as the endpoints controller decides)."""
        with self._dns_lock:
            with self._lock:
                runs = [r for r in self._runs.values() if r.ns == ns and r.net is not None]
            selectors: dict[str, dict[str, str] | None] = {}
            lines = ["127.0.0.1\tlocalhost"]
            for run in sorted(runs, key=lambda r: r.name):
                spec, labels = run.pod["spec"], run.pod["metadata"].get("labels") or {}
                sub = spec["subdomain"]
                if sub not in selectors:
                    selectors[sub] = self._headless_selector(ns, sub)
                selector = selectors[sub]
                if selector is None or not selector.items() <= labels.items():
                    continue
                host = f"{spec['hostname']}.{sub}"
                names = [f"{host}.{ns}.svc.cluster.local", f"{host}.{ns}.svc", f"{host}.{ns}", host]
                lines.append(f"{run.pod_ip}\t" + " ".join(names))
            with open(self.hosts_file(ns), "r+", encoding="utf-8") as f:
                f.truncate(0)
                f.write("\n".join(lines) + "\n")

    # ---------------------------------------------------------------- node
    def _start_log_server(self) -> None:
        cert_dir = self.work_dir / "pki"
        cert_dir.mkdir(exist_ok=True)
        crt, key = cert_dir / "kubelet.crt", cert_dir / "kubelet.key"
        if not crt.exists():
            subprocess.run(
                [
                    "openssl",
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-keyout",
                    str(key),
                    "-out",
                    str(crt),
                    "-days",
                    "30",
                    "-subj",
                    f"/CN={self.node_name}",
                    "-addext",
                    f"subjectAltName=IP:127.0.0.1,DNS:{self.node_name}",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(crt), str(key))
        self._server = _LogServer(self, ctx)
        self.port = self._server.server_address[1]
        self._server_thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True, name="kubelet-endpoint"
        )
        self._server_thread.start()

    def _node_body(self) -> dict[str, Any]:
        ts = now_rfc3339()
        conditions = [
            {
                "type": t,
                "status": "False",
                "reason": r,
                "message": m,
                "lastHeartbeatTime": ts,
                "lastTransitionTime": ts,
            }
            for t, r, m in (
                ("MemoryPressure", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                ("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                ("PIDPressure", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            )
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet is posting ready status (flare node agent, a test harness)",
                "lastHeartbeatTime": ts,
                "lastTransitionTime": ts,
            }
        )
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "beta.kubernetes.io/os": "linux",
                    "beta.kubernetes.io/arch": "amd64",
                    "flare-airflow/node-agent": "true",
                    **self.labels,
                },
            },
            "status": {
                "capacity": self.capacity,
                "allocatable": self.capacity,
                "conditions": conditions,
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
                "nodeInfo": {
                    "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, self.node_name).hex,
                    "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, self.node_name)),
                    "bootID": str(uuid.uuid4()),
                    "kernelVersion": os.uname().release,
                    "osImage": "flare-airflow local node agent (test harness)",
                    "containerRuntimeVersion": AGENT_VERSION,
                    "kubeletVersion": "v1.20.2",
                    "kubeProxyVersion": "v1.20.2",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            },
        }

    def _register_node(self) -> None:
        body = self._node_body()
        try:
            self.core.create_node(body, _preload_content=False)
        except ApiException as e:
            if e.status != 409:
                raise
            self.core.patch_node(
                self.node_name, {"metadata": {"labels": body["metadata"]["labels"]}}, _content_type=SMP
            )
        self.core.patch_node_status(self.node_name, {"status": body["status"]}, _content_type=SMP)
        node = json.loads(self.core.read_node(self.node_name, _preload_content=False).data)
        taints = node["spec"].get("taints") or []
        keep = [t for t in taints if t.get("key") != NOT_READY_TAINT]
        if keep != taints:
            self.core.patch_node(
                self.node_name,
                [{"op": "replace", "path": "/spec/taints", "value": keep}],
                _content_type="application/json-patch+json",
            )

    # ---------------------------------------------------------------- watch
    def _watch_loop(self) -> None:
        selector = f"spec.nodeName={self.node_name}"
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    data = json.loads(
                        self.core.list_pod_for_all_namespaces(
                            field_selector=selector, _preload_content=False, _request_timeout=30
                        ).data
                    )
                    rv = data["metadata"]["resourceVersion"]
                    listed = {p["metadata"]["uid"] for p in data["items"]}
                    with self._lock:
                        vanished = [r for uid, r in self._runs.items() if uid not in listed]
                    for run in vanished:
                        self._on_event("DELETED", run.pod)
                    for pod in data["items"]:
                        self._on_event("MODIFIED", pod)
                    self._synced.set()
                resp = self.core.list_pod_for_all_namespaces(
                    field_selector=selector,
                    watch=True,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=300,
                    _preload_content=False,
                    _request_timeout=(10, 330),
                )
                self._watch_resp = resp
                if self._stop.is_set():
                    resp.shutdown()
                for line in iter_resp_lines(resp):
                    if self._stop.is_set():
                        break
                    ev = json.loads(line)
                    obj = ev.get("object") or {}
                    if ev.get("type") == "ERROR":
                        if obj.get("code") == 410:
                            rv = None  # too old: list again
                        break
                    rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                    if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._on_event(ev["type"], obj)
                with contextlib.suppress(Exception):
                    resp.release_conn()
            except Exception as e:
                if self._stop.is_set():
                    break
                if isinstance(e, ApiException) and e.status == 410:
                    rv = None
                log.warning("node agent watch: %s; retrying", e)
                self._stop.wait(0.5)

    def _on_event(self, kind: str, pod: dict[str, Any]) -> None:
        try:
            self._handle(kind, pod)
        except Exception:
            msg = traceback.format_exc()
            self.errors.append(msg)
            log.error("node agent: handling %s failed:\n%s", kind, msg)

    def _handle(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid, ns, name = meta["uid"], meta["namespace"], meta["name"]
        with self._lock:
            run = self._runs.get(uid)
            if kind == "DELETED":
                if run is not None:
                    self._runs.pop(uid, None)
                    if self._by_name.get((ns, name)) is run:
                        self._by_name.pop((ns, name), None)
                    run.gone.set()
                    run.deleting.set()
                    threading.Thread(target=run.vanish, daemon=True).start()
                self._confirming.discard(uid)
                return
            if run is not None:
                run.pod = pod
                if meta.get("deletionTimestamp"):
                    run.request_delete(meta.get("deletionGracePeriodSeconds"))
                return
            if meta.get("deletionTimestamp"):
                if uid not in self._confirming:
                    self._confirming.add(uid)
                    threading.Thread(target=self.confirm_delete, args=(ns, name, uid), daemon=True).start()
                return
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return  # finished before this agent saw it
            if self._stop.is_set():
                return
            run = _PodRun(self, pod)
            self._runs[uid] = run
            self._by_name[(ns, name)] = run
        run.start()

    def confirm_delete(self, ns: str, name: str, uid: str) -> None:
        """Delete with grace 0 and a UID precondition, as a kubelet confirms a graceful deletion."""
        try:
            self.core.delete_namespaced_pod(
                name,
                ns,
                body=k8s.V1DeleteOptions(grace_period_seconds=0, preconditions=k8s.V1Preconditions(uid=uid)),
                _preload_content=False,
            )
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("node agent: confirming deletion of %s/%s failed: %s", ns, name, e)

    # ---------------------------------------------------------------- events
    def record_event(
        self, pod: dict[str, Any], reason: str, message: str, kind: str = "Normal", container: _Container | None = None
    ) -> None:
        if not self.record_events:
            return
        meta = pod["metadata"]
        ts = now_rfc3339()
        involved: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
            "resourceVersion": meta.get("resourceVersion"),
        }
        if container is not None:
            kind_field = "initContainers" if container.init else "containers"
            involved["fieldPath"] = f"spec.{kind_field}{{{container.name}}}"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": self.node_name},
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
            "reportingComponent": "kubelet",
            "reportingInstance": self.node_name,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body, _preload_content=False)
        except ApiException as e:
            if e.status not in (403, 404, 409):  # namespace terminating, …
                log.warning("node agent: event %s for %s failed: %s", reason, meta["name"], e)

    # ---------------------------------------------------------------- configuration
    def _read(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        fn = self.core.read_namespaced_secret if kind == "secret" else self.core.read_namespaced_config_map
        try:
            return json.loads(fn(name, ns, _preload_content=False).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    @staticmethod
    def _data(kind: str, obj: dict[str, Any]) -> dict[str, str]:
        if kind == "secret":
            return {
                k: base64.b64decode(v).decode("utf-8", "surrogateescape") for k, v in (obj.get("data") or {}).items()
            }
        data = dict(obj.get("data") or {})
        data.update(
            {
                k: base64.b64decode(v).decode("utf-8", "surrogateescape")
                for k, v in (obj.get("binaryData") or {}).items()
            }
        )
        return data

    def _field(self, run: _PodRun, path: str) -> str:
        pod = run.pod
        meta, spec = pod["metadata"], pod["spec"]
        simple = {
            "metadata.name": meta.get("name", ""),
            "metadata.namespace": meta.get("namespace", ""),
            "metadata.uid": meta.get("uid", ""),
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.hostIP": "127.0.0.1",
            "status.podIP": run.pod_ip,
            "status.podIPs": run.pod_ip,
        }
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        if path in ("metadata.labels", "metadata.annotations"):
            items = meta.get(path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
        raise _ConfigError(f'unsupported fieldRef "{path}" (node agent)')

    def _resource(self, c: dict[str, Any], ref: dict[str, Any]) -> str:
        res = ref.get("resource", "")
        kind, _, name = res.partition(".")
        resources = c.get("resources") or {}
        value = (resources.get(kind) or {}).get(name)
        if value is None and kind == "limits":
            value = self.capacity.get(name)
        if value is None:
            value = "0"
        divisor = parse_quantity(ref.get("divisor") or "1")
        return str(math.ceil(parse_quantity(value) / divisor))

    def container_config(
        self, run: _PodRun, c: _Container, volumes: dict[str, str]
    ) -> tuple[list[str], dict[str, str], str]:
        """argv, env and cwd of one container; raises :class:`_ConfigError` like a kubelet would."""
        pod, spec, ns = run.pod, c.spec, run.ns
        cache: dict[tuple[str, str], dict[str, Any] | None] = {}

        def get(kind: str, name: str) -> dict[str, Any] | None:
            if (kind, name) not in cache:
                cache[(kind, name)] = self._read(kind, ns, name)
            return cache[(kind, name)]

        env: dict[str, str] = {
            "HOSTNAME": run.name,
            "KUBERNETES_SERVICE_HOST": self.api_host,
            "KUBERNETES_SERVICE_PORT": str(self.api_port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.api_port),
        }
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix") or ""
            for kind, key in (("configmap", "configMapRef"), ("secret", "secretRef")):
                ref = src.get(key)
                if not ref:
                    continue
                obj = get(kind, ref["name"])
                if obj is None:
                    if ref.get("optional"):
                        continue
                    raise _ConfigError(f'{"secrets" if kind == "secret" else "configmaps"} "{ref["name"]}" not found')
                for k, v in self._data(kind, obj).items():
                    env[prefix + k] = v
        for item in spec.get("env") or []:
            name = item["name"]
            if "valueFrom" not in item:
                env[name] = expand_vars(item.get("value") or "", env)
                continue
            vf = item["valueFrom"]
            if "secretKeyRef" in vf or "configMapKeyRef" in vf:
                kind = "secret" if "secretKeyRef" in vf else "configmap"
                ref = vf["secretKeyRef"] if kind == "secret" else vf["configMapKeyRef"]
                obj = get(kind, ref["name"])
                label = "Secret" if kind == "secret" else "ConfigMap"
                if obj is None:
                    if ref.get("optional"):
                        continue
                    raise _ConfigError(f'{"secrets" if kind == "secret" else "configmaps"} "{ref["name"]}" not found')
                data = self._data(kind, obj)
                if ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise _ConfigError(f"couldn't find key {ref['key']} in {label} {ns}/{ref['name']}")
                env[name] = data[ref["key"]]
            elif "fieldRef" in vf:
                env[name] = self._field(run, vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                env[name] = self._resource(spec, vf["resourceFieldRef"])
        mounts: dict[str, str] = {}
        empty_dirs = {v["name"] for v in pod["spec"].get("volumes") or [] if "emptyDir" in v}
        for m in spec.get("volumeMounts") or []:
            if m["name"] not in volumes:
                raise _ConfigError(f'unable to find volume "{m["name"]}" in pod (node agent)')
            if m["name"] in empty_dirs and m["mountPath"].rstrip("/") == "/tmp":
                continue  # the host's /tmp (see the module docstring)
            local = volumes[m["name"]]
            sub_path = m.get("subPath")
            if sub_path:
                if os.path.isabs(sub_path) or ".." in sub_path.split("/"):
                    raise _ConfigError(f'subPath "{sub_path}" must be a relative path without ".."')
                local = os.path.join(local, sub_path)
                if not os.path.exists(local):  # a file subPath is mounted as it is
                    os.makedirs(local, exist_ok=True)  # as a kubelet creates a missing subPath
            mounts[m["mountPath"]] = local
        mm = MountMap(mounts)
        command = list(spec.get("command") or self.image_entrypoints.get(spec.get("image", ""), []))
        argv = [mm.rewrite(expand_vars(a, env)) for a in command + list(spec.get("args") or [])]
        if not argv:
            raise _ConfigError(
                f'container "{c.name}" has no command and the node agent knows no entrypoint for image '
                f'"{spec.get("image", "")}"'
            )
        proc_env = dict(self.base_env)
        proc_env.update({k: mm.rewrite(v) for k, v in env.items()})
        proc_env["FLARE_NODE_AGENT_MOUNTS"] = json.dumps(mm.mounts)
        cwd = run.dir / "cwd"
        cwd.mkdir(exist_ok=True)
        wd = mm.rewrite(spec.get("workingDir") or "")
        return argv, proc_env, wd if wd and os.path.isdir(wd) else str(cwd)

    def resolve_volumes(self, run: _PodRun) -> dict[str, str]:
        out: dict[str, str] = {}
        base = run.dir / "volumes"
        for vol in run.pod["spec"].get("volumes") or []:
            name = vol["name"]
            if "hostPath" in vol:
                hp = vol["hostPath"]
                path, kind = hp["path"], hp.get("type") or ""
                if kind == "DirectoryOrCreate":
                    os.makedirs(path, exist_ok=True)
                elif kind == "FileOrCreate" and not os.path.exists(path):
                    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                    pathlib.Path(path).touch()
                elif kind in ("Directory", "File", "Socket", "CharDevice", "BlockDevice") and not os.path.exists(path):
                    raise _MountError(
                        f'MountVolume.SetUp failed for volume "{name}" : hostPath type check failed: {path} '
                        f"is not a {kind.lower()}"
                    )
                out[name] = path
            elif "emptyDir" in vol:
                d = base / "empty-dir" / name
                d.mkdir(parents=True, exist_ok=True)
                out[name] = str(d)
            elif "persistentVolumeClaim" in vol:
                out[name] = self._pvc_path(run.ns, name, vol["persistentVolumeClaim"]["claimName"])
            elif "secret" in vol or "configMap" in vol:
                kind = "secret" if "secret" in vol else "configmap"
                src = vol["secret"] if kind == "secret" else vol["configMap"]
                ref_name = src.get("secretName") if kind == "secret" else src.get("name")
                obj = self._read(kind, run.ns, ref_name)
                if obj is None and not src.get("optional"):
                    raise _MountError(
                        f'MountVolume.SetUp failed for volume "{name}" : '
                        f'{"secret" if kind == "secret" else "configmap"} "{ref_name}" not found'
                    )
                d = base / kind / name
                d.mkdir(parents=True, exist_ok=True)
                data = self._data(kind, obj) if obj else {}
                items = src.get("items") or [{"key": k, "path": k} for k in data]
                for it in items:
                    if it["key"] in data:
                        f = d / it["path"]
                        f.parent.mkdir(parents=True, exist_ok=True)
                        f.write_text(data[it["key"]], errors="surrogateescape")
                out[name] = str(d)
            elif "downwardAPI" in vol:
                d = base / "downward-api" / name
                d.mkdir(parents=True, exist_ok=True)
                for it in vol["downwardAPI"].get("items") or []:
                    if "fieldRef" in it:
                        try:
                            (d / it["path"]).write_text(self._field(run, it["fieldRef"]["fieldPath"]))
                        except _ConfigError as e:
                            raise _MountError(str(e)) from None
                out[name] = str(d)
            elif "projected" in vol:
                d = base / "projected" / name
                d.mkdir(parents=True, exist_ok=True)
                out[name] = str(d)
            else:
                kinds = [k for k in vol if k != "name"]
                raise _MountError(
                    f'MountVolume.SetUp failed for volume "{name}" : unsupported by the node agent: {kinds}'
                )
        return out

    def _pvc_path(self, ns: str, vol: str, claim: str) -> str:
        if claim in self.pvc_paths:
            path = self.pvc_paths[claim]
            os.makedirs(path, exist_ok=True)
            return path
        try:
            pvc = json.loads(self.core.read_namespaced_persistent_volume_claim(claim, ns, _preload_content=False).data)
        except ApiException as e:
            if e.status == 404:
                raise _MountError(
                    f'Unable to attach or mount volumes: unmounted volumes=[{vol}]: persistentvolumeclaim "{claim}" '
                    "not found"
                ) from None
            raise
        pv_name = (pvc.get("spec") or {}).get("volumeName")
        if not pv_name or (pvc.get("status") or {}).get("phase") != "Bound":
            raise _MountError(
                f'Unable to attach or mount volumes: unmounted volumes=[{vol}]: PVC "{claim}" is not bound'
            )
        pv = json.loads(self.core.read_persistent_volume(pv_name, _preload_content=False).data)
        spec = pv.get("spec") or {}
        path = (spec.get("hostPath") or {}).get("path") or (spec.get("local") or {}).get("path")
        if not path:
            raise _MountError(
                f'MountVolume.SetUp failed for volume "{pv_name}" : the node agent mounts only hostPath/local PVs'
            )
        os.makedirs(path, exist_ok=True)
        return path

    # ---------------------------------------------------------------- logs
    def serve_logs(self, h: _LogHandler, ns: str, pod: str, container: str, q: dict[str, str]) -> None:
        with self._lock:
            run = self._by_name.get((ns, pod))
        if run is None:
            return h._send(404, f'pod "{pod}" in namespace "{ns}" not found on node {self.node_name}')
        c = run.container(container)
        if c is None:
            return h._send(404, f'container "{container}" in pod "{pod}" not found')
        previous = q.get("previous") in ("true", "1")
        if previous:
            if c.restart_count == 0:
                return h._send(400, f'previous terminated container "{container}" in pod "{pod}" not found')
            path = c.log_path(c.restart_count - 1)
        else:
            if not c.container_id:
                reason = (c.state.get("waiting") or {}).get("reason", "ContainerCreating")
                return h._send(400, f'container "{container}" in pod "{pod}" is waiting to start: {reason}')
            path = c.log_path()
        follow = q.get("follow") in ("true", "1") and not previous
        timestamps = q.get("timestamps") in ("true", "1")
        tail = int(q["tailLines"]) if q.get("tailLines") not in (None, "") else None
        limit = int(q["limitBytes"]) if q.get("limitBytes") not in (None, "") else None
        since: float | None = None
        if q.get("sinceSeconds"):
            since = time.time() - int(q["sinceSeconds"])
        elif q.get("sinceTime"):
            since = _parse_ts(q["sinceTime"])

        def render(raw: bytes) -> bytes | None:
            ts, _, rest = raw.partition(b" ")
            _stream, _, rest = rest.partition(b" ")
            tag, _, content = rest.partition(b" ")
            if content.endswith(b"\n"):
                content = content[:-1]
            if since is not None and _parse_ts(ts.decode()) < since:
                return None
            out = content + (b"\n" if tag == b"F" else b"")
            return (ts + b" " + out) if timestamps else out

        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        sent = 0

        def emit(data: bytes) -> bool:
            nonlocal sent
            if limit is not None:
                data = data[: max(0, limit - sent)]
            if not data:
                return limit is None or sent < limit
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()
            sent += len(data)
            return limit is None or sent < limit

        try:
            with c.log_lock:
                lines = path.read_bytes().splitlines(keepends=True) if path.exists() else []
            if lines and not lines[-1].endswith(b"\n"):
                lines.pop()
            offset = sum(len(x) for x in lines)
            if tail is not None:
                lines = lines[-tail:] if tail > 0 else []
            ok = emit(b"".join(r for r in map(render, lines) if r is not None))
            while ok and follow and not self._stop.is_set():
                finished = c.terminated or run.gone.is_set() or (c.proc is None and not c.running)
                with c.log_lock:
                    size = path.stat().st_size if path.exists() else 0
                if size > offset:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        chunk = f.read(size - offset)
                    cut = chunk.rfind(b"\n") + 1
                    new, offset = chunk[:cut], offset + cut
                    ok = emit(b"".join(r for r in map(render, new.splitlines(keepends=True)) if r is not None))
                    continue
                if finished and all(not t.is_alive() for t in c.readers):
                    break
                time.sleep(0.1)
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            pass
        return None


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="LOCAL NODE AGENT (test harness) for the flare-airflow test control plane")
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--node-name", default="flare-node-1")
    p.add_argument("--work-dir")
    p.add_argument("--gpus", default="4")
    p.add_argument("--pvc", action="append", default=[], help="CLAIM=LOCAL_PATH (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    capacity = dict(DEFAULT_CAPACITY, **{"nvidia.com/gpu": args.gpus})
    pvc = dict(item.split("=", 1) for item in args.pvc)
    agent = NodeAgent(
        kubeconfig=args.kubeconfig, node_name=args.node_name, work_dir=args.work_dir, capacity=capacity, pvc_paths=pvc
    ).start()
    print(f"node {agent.node_name} ready; kubelet endpoint https://127.0.0.1:{agent.port}", file=sys.stderr)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_main())


__all__ = ["DEFAULT_CAPACITY", "Faults", "MountMap", "NodeAgent", "expand_vars"]
