"""Kubernetes API cost of one site job: how many requests the Airflow side makes, against a real control plane.

A real kube-apiserver / scheduler / controller-manager (v1.20.2, ``flare_airflow_testing.k8s.control_plane``)
with the LOCAL NODE AGENT test harness playing the kubelet (it runs each pod's command as a local
process). Four ways of running one pod-per-job task, each for a job of ~10 s and of ~60 s:

* ours, deferrable (the default): :class:`flare_airflow.operators.pod.SitePodOperator` defers to
  :class:`flare_airflow.triggers.pod_state.PodStateTrigger`, which is run inline with asyncio, then
  ``trigger_reentry`` -- what Airflow's worker / triggerer / worker do, without the scheduler;
* ours, sync (``op.deferrable = False``): the same trigger run inside ``execute``;
* stock ``KubernetesPodOperator`` sync, and deferrable (``KubernetesPodTrigger`` inline), with
  ``get_logs=True``, ``on_finish_action="delete_pod"``, ``poll_interval=2``.

Ours runs ``sleep_trainer.py`` (Client API: ``receive()``, sleep N s, ``send()``); the stock operator
runs ``python -c 'time.sleep(N)'``. All eight cases run at the same time, each in its own namespace
(one thread each), so the benchmark takes about one long job. Each case's count is the apiserver's
audit log filtered to its namespace and to client users (not the apiserver, scheduler,
controller-manager or node agent), from a mark taken after the namespaces were set up and read
before anything else touches them. Every case must succeed (task result and pod phase checked, the
task took at least N s) and every pod must be gone afterwards; otherwise the benchmark fails.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench_common import BenchmarkFailed, Table, log

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:  # flare_airflow_testing.k8s and flare_airflow from this checkout
    sys.path.insert(0, str(REPO))

TRAINER = BENCH_DIR / "sleep_trainer.py"
DURATIONS = (10, 60)
QUICK_DURATIONS = (5, 20)
RUN_ID = "manual__2026-11-30T00:00:00+00:00"
JOB = "k8sapi"
SITE = "site-1"
STOCK_POLL_INTERVAL = 2
OURS_TRIGGER = "flare_airflow.triggers.pod_state.PodStateTrigger"
STOCK_TRIGGER = "airflow.providers.cncf.kubernetes.triggers.pod.KubernetesPodTrigger"
CASE_SLACK_SECONDS = 180  # a case that has not ended this long after its job should have is a failure

# The breakdown columns: (column, audit "verb resource[/subresource]" it counts).
COLUMNS = (
    ("create pods", "create pods"),
    ("get pod", "get pods"),
    ("list pods", "list pods"),
    ("watch pods", "watch pods"),
    ("log", "get pods/log"),
    ("events", "events"),
    ("delete", "delete pods"),
)


@dataclass(frozen=True)
class Kind:
    key: str
    label: str
    ours: bool
    deferrable: bool


KINDS = (
    Kind("ours-deferrable", "ours: `SitePodOperator`, deferrable (default)", ours=True, deferrable=True),
    Kind("ours-sync", "ours: `SitePodOperator`, sync", ours=True, deferrable=False),
    Kind("stock-sync", "stock: `KubernetesPodOperator`, sync", ours=False, deferrable=False),
    Kind("stock-deferrable", "stock: `KubernetesPodOperator`, deferrable", ours=False, deferrable=True),
)


@dataclass(frozen=True)
class Case:
    kind: Kind
    seconds: int

    @property
    def key(self) -> str:
        return f"{self.kind.key}-{self.seconds}s"


@dataclass
class CaseResult:
    case: Case
    namespace: str
    wall: float = 0.0  # execute -> (trigger) -> trigger_reentry, seconds
    deferrals: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    watch_timeouts: list[str] = field(default_factory=list)  # timeoutSeconds of each pod watch, in order


# --- one case ---------------------------------------------------------------------------------------


def _context(dag_id: str, task_id: str) -> dict[str, Any]:
    """The minimal task context the operators read (as tests/integration/k8s does)."""
    ti = SimpleNamespace(
        dag_id=dag_id,
        task_id=task_id,
        map_index=-1,
        try_number=1,
        start_date=datetime.now(UTC),
        xcom_push=lambda *a, **k: None,
    )
    return {"ti": ti, "task_instance": ti, "run_id": RUN_ID, "dag": SimpleNamespace(dag_id=dag_id), "params": {}}


def _ours(case: Case, root: Path, namespace: str, kubeconfig: Path) -> Any:
    import numpy as np
    from safetensors.numpy import save_file

    from flare_airflow.core.config import job_from_dict
    from flare_airflow.core.model import FLModel, write_artifact
    from flare_airflow.core.store import ModelStore
    from flare_airflow.operators.pod import SitePodOperator

    store = root / "store"
    store.mkdir(parents=True)
    params = {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}
    save_file(params, str(root / "init.safetensors"))
    job = job_from_dict(
        {
            "job": JOB,
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(root / "init.safetensors"),
            "store": f"file://{store}",
            "trainer": {"script": str(TRAINER), "args": ["--seconds", str(case.seconds)]},
            "sites": {
                SITE: {
                    "launcher": "k8s",
                    "launcher_spec": {
                        "k8s": {
                            "image": "registry.example/flare/trainer:1",
                            "namespace": namespace,
                            "config_file": str(kubeconfig),
                            "store_mount": {"host_path": str(store), "mount_path": "/flare-store"},
                            "trainer_command": [sys.executable],
                            "trainer_script": str(TRAINER),
                            # poll_interval, pending/startup timeouts: the defaults
                        }
                    },
                }
            },
        }
    )
    write_artifact(ModelStore(store).global_model(JOB, RUN_ID, 0), FLModel(params=params))
    op = SitePodOperator(task_id=SITE, job=job, site=SITE, round_num=1)
    op.deferrable = case.kind.deferrable
    return op


def _stock(case: Case, namespace: str, kubeconfig: Path) -> Any:
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    code = f"import time; print('sleeping {case.seconds} s', flush=True); time.sleep({case.seconds}); print('done')"
    return KubernetesPodOperator(
        task_id="stock-pod",
        namespace=namespace,
        name="stock-pod",
        image="python:3.11-slim",
        cmds=[sys.executable, "-c", code],
        config_file=str(kubeconfig),
        in_cluster=False,
        get_logs=True,
        on_finish_action="delete_pod",
        poll_interval=STOCK_POLL_INTERVAL,
        random_name_suffix=True,
        deferrable=case.kind.deferrable,
    )


async def _first_event(trigger: Any) -> dict[str, Any]:
    async for event in trigger.run():
        return dict(event.payload)
    raise BenchmarkFailed(f"{type(trigger).__name__} ended without an event")


def _run_operator(op: Any, context: dict[str, Any], result: CaseResult) -> tuple[Any, list[dict[str, Any]]]:
    """What Airflow does with the task: ``execute``; on ``TaskDeferred`` run the trigger to its first
    event (inline, asyncio) and call the re-entry method -- again if it defers again."""
    from airflow.sdk.exceptions import TaskDeferred

    events: list[dict[str, Any]] = []
    expected = OURS_TRIGGER if result.case.kind.ours else STOCK_TRIGGER
    call = lambda: op.execute(context)  # noqa: E731
    while True:
        try:
            return call(), events
        except TaskDeferred as deferred:
            result.deferrals += 1
            trigger, method = deferred.trigger, deferred.method_name
            classpath = trigger.serialize()[0]
            if classpath != expected:
                raise BenchmarkFailed(f"{result.case.key}: deferred to {classpath}, not {expected}") from None
            event = asyncio.run(_first_event(trigger))
            events.append(event)
            call = lambda m=method, e=event: getattr(op, m)(context, e)  # noqa: E731


def _check_success(case: Case, op: Any, value: Any, events: list[dict[str, Any]], root: Path) -> None:
    """Fail loudly unless the task did what it should: a deferral exactly when deferrable, a
    successful event, the pod Succeeded (stock) / the update written (ours)."""
    if case.kind.deferrable != bool(events):
        raise BenchmarkFailed(f"{case.key}: deferrable={case.kind.deferrable} but {len(events)} deferral(s)")
    bad = [e for e in events if e.get("status") != "success"]
    if bad:
        raise BenchmarkFailed(f"{case.key}: trigger event not success: {bad}")
    if case.kind.ours:
        from flare_airflow.core.store import ModelStore

        if not isinstance(value, dict) or value.get("site") != SITE or value.get("num_samples") != 10:
            raise BenchmarkFailed(f"{case.key}: unexpected task result {value!r}")
        update = ModelStore(root / "store").site_update(JOB, RUN_ID, 1, SITE)
        if not Path(update).is_file():
            raise BenchmarkFailed(f"{case.key}: no site update at {update}")
    else:
        pod = op.pod if case.kind.deferrable else op.remote_pod
        phase = getattr(getattr(pod, "status", None), "phase", None)
        if phase != "Succeeded":
            raise BenchmarkFailed(f"{case.key}: stock pod ended in phase {phase!r}")


def run_case(case: Case, namespace: str, kubeconfig: Path, root: Path) -> CaseResult:
    result = CaseResult(case, namespace)
    root.mkdir(parents=True)
    if case.kind.ours:
        op = _ours(case, root, namespace, kubeconfig)
        context = _context(f"{JOB}_dag", SITE)
    else:
        op = _stock(case, namespace, kubeconfig)
        context = _context("stock_dag", "stock-pod")
    t0 = time.monotonic()
    value, events = _run_operator(op, context, result)
    result.wall = time.monotonic() - t0
    _check_success(case, op, value, events, root)
    if result.wall < case.seconds:
        raise BenchmarkFailed(f"{case.key}: the task took {result.wall:.1f} s, less than its {case.seconds} s job")
    return result


# --- the harness --------------------------------------------------------------------------------------


def _category(ev: dict[str, Any]) -> str:
    from flare_airflow_testing.k8s.audit import describe

    what = describe(ev)
    if (ev.get("objectRef") or {}).get("resource") == "events":
        return "events"
    return what


def _received(ev: dict[str, Any]) -> str:
    return str(ev.get("requestReceivedTimestamp", ""))


def _query(ev: dict[str, Any], key: str) -> str:
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(ev.get("requestURI", "")).query)
    return query.get(key, ["-"])[0]


def _start_control_plane(base: Path) -> Any:
    """A fresh control plane; retried once (another session may take a port between pick and bind)."""
    from flare_airflow_testing.k8s.control_plane import ControlPlane, ControlPlaneError

    for attempt in (1, 2):
        cp = ControlPlane(base / f"control-plane-{attempt}")
        try:
            return cp.start()
        except ControlPlaneError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if attempt == 2:
                raise BenchmarkFailed(f"the Kubernetes control plane did not start twice: {exc}") from None
            log(f"[k8s] control plane did not start ({first}); retrying once (a port clash?)")
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _private_airflow_home(base: Path) -> Any:
    """Airflow is imported in this process: give it a private home, not ~/airflow."""
    keys = ("AIRFLOW_HOME", "AIRFLOW__CORE__LOAD_EXAMPLES")
    saved = {k: os.environ.get(k) for k in keys}
    if "airflow" not in sys.modules:
        os.environ["AIRFLOW_HOME"] = str(base / "airflow-home")
        os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _quiet_loggers() -> None:
    """The operators log the pods' lines and their progress; the benchmark's stderr stays readable."""
    import logging

    for name in ("airflow", "airflow.task", "kubernetes", "kubernetes_asyncio", "flare_airflow", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _measure(base: Path, durations: tuple[int, ...]) -> tuple[dict[str, CaseResult], list[str], float]:
    from kubernetes import client as k8s

    from flare_airflow_testing.k8s.audit import ADMIN_USER, AuditLog
    from flare_airflow_testing.k8s.kube import wait_for
    from flare_airflow_testing.k8s.node_agent import NodeAgent

    t0 = time.monotonic()
    cp = _start_control_plane(base)
    agent = None
    try:
        log(f"[k8s] control plane v1.20.2 ready in {cp.start_seconds:.1f} s at {cp.server}")
        agent = NodeAgent(
            kubeconfig=cp.kubeconfig_path("node"), node_name="flare-bench-node", work_dir=base / "node"
        ).start()
        core = k8s.CoreV1Api(cp.api_client())
        audit = AuditLog(cp.audit_log)
        cases = [Case(kind, secs) for kind in KINDS for secs in durations]
        tag = uuid.uuid4().hex[:6]
        namespaces = {c.key: f"bench-{c.key}-{tag}" for c in cases}
        for ns in namespaces.values():
            core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=ns)))
        for ns in namespaces.values():  # the controller-manager adds the default ServiceAccount
            wait_for(lambda ns=ns: core.list_namespaced_service_account(ns).items, 30, what=f"default SA in {ns}")
        setup_s = time.monotonic() - t0
        log(f"[k8s] node agent and {len(namespaces)} namespaces ready ({setup_s:.1f} s since start)")

        mark = audit.mark()  # from here on, only the operators touch the namespaces until counted
        results: dict[str, CaseResult] = {}
        failures: dict[str, str] = {}

        def worker(case: Case) -> None:
            try:
                results[case.key] = run_case(case, namespaces[case.key], cp.kubeconfig, base / "cases" / case.key)
                log(f"[k8s] {case.key}: done in {results[case.key].wall:.1f} s")
            except BaseException as exc:  # reported below, after every case has ended
                failures[case.key] = "".join(traceback.format_exception(exc))
                log(f"[k8s] {case.key}: FAILED: {exc}")

        threads = [threading.Thread(target=worker, args=(c,), name=c.key, daemon=True) for c in cases]
        log(f"[k8s] running {len(cases)} cases at once (jobs of {' and '.join(f'{s} s' for s in durations)}) ...")
        for t in threads:
            t.start()
        deadline = time.monotonic() + max(durations) + CASE_SLACK_SECONDS
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in threads if t.is_alive()]
        if hung:
            raise BenchmarkFailed(f"cases still running {max(durations) + CASE_SLACK_SECONDS} s after start: {hung}")
        if failures:
            raise BenchmarkFailed("cases failed:\n" + "\n".join(f"--- {k}\n{v}" for k, v in failures.items()))

        audit.settle(quiet=1.0, timeout=10)
        for case in cases:
            res = results[case.key]
            requests = sorted(audit.client_requests(res.namespace, since=mark), key=_received)
            res.counts.update(_category(ev) for ev in requests)
            res.watch_timeouts = [_query(ev, "timeoutSeconds") for ev in requests if _category(ev) == "watch pods"]
        # Requests that name no namespace cannot be attributed to a case (discovery, /version ...).
        unattributed = sorted(
            {
                f"{ev.get('verb')} {ev.get('requestURI', '?').split('?')[0]}"
                for ev in audit.requests(since=mark, users=[ADMIN_USER])
                if not (ev.get("objectRef") or {}).get("namespace")
            }
        )

        # Nothing may be left behind: every pod gone (deletions are graceful: give them time), no process.
        for case in cases:
            ns = namespaces[case.key]
            try:
                wait_for(lambda ns=ns: not core.list_namespaced_pod(ns).items, 30, what=f"no pod left in {ns}")
            except TimeoutError:
                left = [f"{p.metadata.name} ({p.status.phase})" for p in core.list_namespaced_pod(ns).items]
                raise BenchmarkFailed(f"{case.key}: pods left in {ns}: {', '.join(left)}") from None
        try:
            wait_for(lambda: not agent.running_processes(), 15, what="no container process left")
        except TimeoutError:
            raise BenchmarkFailed(f"container processes left on the node: {agent.running_processes()}") from None
        for ns in namespaces.values():
            core.delete_namespace(ns)
    finally:
        if agent is not None:
            agent.stop()
        cp.stop()
    if agent.errors:
        raise BenchmarkFailed("node agent errors:\n" + "\n".join(agent.errors))
    return results, unattributed, setup_s


def run(*, quick: bool, keep: bool, tmp_base: str | None) -> list[Table]:
    durations = QUICK_DURATIONS if quick else DURATIONS
    base = Path(tempfile.mkdtemp(prefix="flare-bench-k8s-", dir=tmp_base))
    ok = False
    started = time.monotonic()
    try:
        with _private_airflow_home(base):
            import airflow.providers.cncf.kubernetes  # noqa: F401 - imported with the private home

            _quiet_loggers()
            results, unattributed, setup_s = _measure(base, durations)
        ok = True
    finally:
        if keep or not ok:
            log(f"[k8s] kept {base} (control-plane logs and audit log under control-plane-*/logs)")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return [_table(results, durations, unattributed, setup_s, time.monotonic() - started)]


# --- the report --------------------------------------------------------------------------------------


def _split(counts: collections.Counter[str]) -> tuple[list[int], dict[str, int]]:
    known = {what for _, what in COLUMNS}
    cells = [counts.get(what, 0) for _, what in COLUMNS]
    other = {k: v for k, v in sorted(counts.items()) if k not in known}
    return cells, other


def _other(other: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in other.items()) or "0"


def _table(
    results: dict[str, CaseResult], durations: tuple[int, ...], unattributed: list[str], setup_s: float, took: float
) -> Table:
    short, long_ = durations
    table = Table(
        f"API requests of ONE site job, by the Airflow side ({short} s and {long_} s jobs)",
        ["case", "job s", "task s", "total", *(c for c, _ in COLUMNS), "other"],
    )
    growth: dict[str, int] = {}
    for kind in KINDS:
        rows = {}
        for secs in durations:
            res = results[Case(kind, secs).key]
            cells, other = _split(res.counts)
            rows[secs] = (sum(res.counts.values()), cells, other)
            table.add(kind.label, secs, f"{res.wall:.1f}", rows[secs][0], *cells, _other(other))
        (t_s, c_s, o_s), (t_l, c_l, o_l) = rows[short], rows[long_]
        growth[kind.key] = t_l - t_s
        o_delta = {k: o_l.get(k, 0) - o_s.get(k, 0) for k in sorted(set(o_s) | set(o_l))}
        table.add(
            f"↳ **grows with duration?** ({long_} s - {short} s)",
            f"+{long_ - short}",
            "",
            f"**{t_l - t_s:+d}**",
            *(f"{b - a:+d}" for a, b in zip(c_s, c_l, strict=True)),
            ", ".join(f"{v:+d} {k}" for k, v in o_delta.items() if v) or "+0",
        )
    extra = long_ - short
    versions = ", ".join(
        f"{d} {_version(d)}" for d in ("apache-airflow-providers-cncf-kubernetes", "kubernetes", "kubernetes_asyncio")
    )
    table.notes += [
        "Counted from the kube-apiserver's audit log (one entry per request: a watch or a followed log "
        "stream is one request however long it stays open), filtered to the case's own namespace and to "
        "client users: what the API server, scheduler, controller-manager and node agent (the kubelet's "
        "part) ask is not counted. Real control plane v1.20.2 (`flare_airflow_testing/k8s`), the LOCAL NODE AGENT "
        f"test harness as the node; {versions}. Ours runs `benchmarks/sleep_trainer.py` (Client API: "
        "receive, sleep N s, send) with the site's defaults (`poll_interval` 2 s, pending/startup "
        "timeouts 300/120 s); stock runs `python -c 'time.sleep(N)'` with `get_logs=True`, "
        f"`on_finish_action='delete_pod'`, `poll_interval={STOCK_POLL_INTERVAL}`, everything else at its "
        "default. Deferrable cases run `execute`, the trigger inline (asyncio) until its event, then "
        "`trigger_reentry`, as worker, triggerer and worker would ('task s' is that whole sequence); "
        "Airflow's scheduler and metadata DB are not involved. All eight cases ran at the same time, one "
        "thread and one namespace each, and each was checked: a deferral exactly in deferrable mode, the "
        "trigger's event `success`, the task's result (ours: the update written; stock: pod `Succeeded`), "
        "the task lasting at least N s, no pod and no container process left. Request counts are counts, "
        f"not timings: one run per case. Set-up {setup_s:.0f} s, whole benchmark {took:.0f} s.",
    ]
    if unattributed:
        table.notes += [
            "Requests by the same client user that name no namespace (so no case): "
            + ", ".join(f"`{u}`" for u in unattributed)
            + "."
        ]
    reading = []
    for kind in KINDS:
        a, b = (results[Case(kind, secs).key] for secs in durations)
        deltas = [(name, b.counts[what] - a.counts[what]) for name, what in COLUMNS]
        grew = [f"{name} {d:+d}" for name, d in deltas if d]
        sentence = f"{kind.label}: **{growth[kind.key]:+d}**" + (f" ({', '.join(grew)})" if grew else "")
        gets = b.counts["get pods"] - a.counts["get pods"]
        if gets > 1:
            sentence += f", one more pod read per {extra / gets:.1f} s of job"
        reading.append(sentence)
    ours_watches = "; ".join(
        f"{Case(kind, secs).key}: {', '.join(results[Case(kind, secs).key].watch_timeouts) or 'none'}"
        for kind in KINDS
        if kind.ours
        for secs in durations
    )
    table.notes += [
        f"**Reading.** Requests added by {extra} s more of job: " + "; ".join(reading) + ".",
        "Ours waits with one `list` + one `watch` on its pod (field selector): the watch stays open until "
        "the pod ends, and is re-opened (another `list` + `watch`) only when it times out -- opened while "
        "the pod is Pending it times out after min(pending, startup timeout) / 2 = 60 s so the deadlines "
        "get checked, once the pod runs after 300 s (watch `timeoutSeconds` seen here, in order: "
        f"{ours_watches}). So its cost is a constant per job plus at most one `list` + `watch` per 5 "
        "minutes of running (plus one after the first minute if the watch was opened on a Pending pod), "
        "in both modes (sync runs the same trigger in the worker). After the event, the stock operator's "
        "`trigger_reentry` / clean-up (inherited) reads the pod a few times, reads its log once and "
        "deletes it. The stock deferrable trigger instead reads the pod every `poll_interval` for as long "
        "as the job runs: its count grows linearly with the job's duration. The stock sync operator "
        "follows the log stream (one request for the job's whole life) and polls the pod only while it "
        "starts (every `startup_check_interval_seconds`, 5 s) and after it ends, so it is flat too; both "
        "sync modes hold a worker slot for the whole job.",
    ]
    table.notes = [n for note in table.notes for n in ("", note)][1:]  # blank lines: separate paragraphs
    return table


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
