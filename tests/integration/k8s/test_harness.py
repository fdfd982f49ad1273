"""Tests of the Kubernetes test harness itself: the real control plane + the LOCAL NODE AGENT.

Every pod here is created through the real API, bound by the real kube-scheduler and run by the
node agent as a local process; statuses and logs are read back through the real API.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import pytest
from kubernetes import client as k8s

from flare_airflow_testing.k8s.audit import ADMIN_USER, NODE_AGENT_USER, AuditLog, format_summary
from flare_airflow_testing.k8s.control_plane import ControlPlane
from flare_airflow_testing.k8s.kube import (
    container_state,
    create_local_volume,
    delete_and_wait,
    pod_dict,
    python_pod,
    read_log,
    wait_for,
    wait_for_phase,
    wait_for_waiting_reason,
)
from flare_airflow_testing.k8s.node_agent import NodeAgent

PY = sys.executable


def _pid_of(pod: dict) -> int:
    """The agent puts the process id into the containerID: flare-node-agent://0.1/<pid>-<hex>."""
    assert "running" in container_state(pod), pod["status"]
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    return int(cid.rsplit("/", 1)[1].split("-")[0])


def _alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_node_registered_ready_untainted(core: k8s.CoreV1Api, node_agent: NodeAgent) -> None:
    node = core.read_node(node_agent.node_name)
    assert node.status.allocatable["nvidia.com/gpu"] == "4"
    assert node.status.capacity["cpu"] == "8"
    assert node.status.capacity["memory"] == "32Gi"
    ready = [c for c in node.status.conditions if c.type == "Ready"]
    assert ready and ready[0].status == "True"
    assert not [t for t in node.spec.taints or [] if t.key == "node.kubernetes.io/not-ready"]
    assert node.status.addresses[0].address == "127.0.0.1"
    assert node.status.daemon_endpoints.kubelet_endpoint.port == node_agent.port


def test_pod_succeeds_and_logs_go_through_the_apiserver(
    core: k8s.CoreV1Api, namespace: str, audit: AuditLog, node_agent: NodeAgent
) -> None:
    mark = audit.mark()
    core.create_namespaced_pod(namespace, python_pod("hello", "print('hi')", PY))
    pod = wait_for_phase(core, namespace, "hello")
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["spec"]["nodeName"] == node_agent.node_name
    assert pod["status"]["podIP"] == "127.0.0.1"
    term = container_state(pod)["terminated"]
    assert term["exitCode"] == 0
    assert term["reason"] == "Completed"
    # client → kube-apiserver → node agent's kubelet endpoint
    assert read_log(core, namespace, "hello") == "hi\n"
    assert read_log(core, namespace, "hello", follow=True) == "hi\n"
    stamped = read_log(core, namespace, "hello", timestamps=True)
    assert stamped.endswith("Z hi\n") and stamped.startswith("20")
    delete_and_wait(core, namespace, "hello")

    audit.settle()
    reqs = audit.requests(since=mark, namespace=namespace, pod="hello")
    print(f"\nAPI requests for one pod (create → Succeeded → 3 log reads → delete):\n{format_summary(reqs)}")
    by_user = {u: [r for r in reqs if r["user"]["username"] == u] for u in (ADMIN_USER, NODE_AGENT_USER)}
    assert any(r["verb"] == "create" and "subresource" not in r["objectRef"] for r in by_user[ADMIN_USER])
    assert sum(1 for r in by_user[ADMIN_USER] if r["objectRef"].get("subresource") == "log") == 3
    assert any(r["objectRef"].get("subresource") == "status" for r in by_user[NODE_AGENT_USER])
    assert any(r["verb"] == "delete" for r in by_user[NODE_AGENT_USER])  # the kubelet-style confirmation


def test_log_tail_and_follow_while_running(core: k8s.CoreV1Api, namespace: str) -> None:
    code = (
        "import time\nfor i in range(5): print(f'line {i}', flush=True)\ntime.sleep(1.5)\nprint('late', flush=True)\n"
    )
    core.create_namespaced_pod(namespace, python_pod("tail", code, PY))
    wait_for_phase(core, namespace, "tail", ("Running", "Succeeded"))
    wait_for(lambda: "line 4" in read_log(core, namespace, "tail"), 10, what="first lines")
    assert read_log(core, namespace, "tail", tail_lines=2) == "line 3\nline 4\n"
    followed = read_log(core, namespace, "tail", follow=True)  # returns when the process ends
    assert followed == "".join(f"line {i}\n" for i in range(5)) + "late\n"
    assert wait_for_phase(core, namespace, "tail")["status"]["phase"] == "Succeeded"
    delete_and_wait(core, namespace, "tail")


def test_exit_code_3_fails_the_pod(core: k8s.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, python_pod("three", "import sys; print('bye'); sys.exit(3)", PY))
    pod = wait_for_phase(core, namespace, "three")
    assert pod["status"]["phase"] == "Failed"
    term = container_state(pod)["terminated"]
    assert (term["exitCode"], term["reason"]) == (3, "Error")
    delete_and_wait(core, namespace, "three")


def test_secret_env_reaches_the_process_but_not_the_spec(core: k8s.CoreV1Api, namespace: str) -> None:
    value = f"s3cr3t-{uuid.uuid4().hex}"
    code = (
        "import hashlib, os; print(hashlib.sha256(os.environ['TOKEN'].encode()).hexdigest()); print(os.environ['ME'])"
    )
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    # The Secret does not exist yet: CreateContainerConfigError with the kubelet's message.
    core.create_namespaced_pod(namespace, python_pod("secret-env", code, PY, env=env))
    pod = wait_for_waiting_reason(core, namespace, "secret-env", ("CreateContainerConfigError",))
    assert container_state(pod)["waiting"]["message"] == 'secrets "creds" not found'
    assert pod["status"]["phase"] == "Pending"
    # Once it exists the agent (retrying, like a kubelet) starts the container.
    core.create_namespaced_secret(
        namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="creds"), string_data={"token": value})
    )
    pod = wait_for_phase(core, namespace, "secret-env", timeout=30)
    assert pod["status"]["phase"] == "Succeeded"
    assert value not in json.dumps(pod)
    digest, me = read_log(core, namespace, "secret-env").split()
    assert digest == hashlib.sha256(value.encode()).hexdigest()
    assert me == "secret-env"
    delete_and_wait(core, namespace, "secret-env")


def test_fifth_gpu_pod_waits_for_a_free_gpu(core: k8s.CoreV1Api, namespace: str, tmp_path: pathlib.Path) -> None:
    gpu = {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}
    code = (
        "import os, sys, time\n"
        "release = sys.argv[1]\n"
        "while not os.path.exists(release): time.sleep(0.05)\n"
        "print('done')\n"
    )
    for i in range(5):
        pod = python_pod(f"gpu-{i}", code, PY, args=[str(tmp_path / f"release-{i}")], resources=gpu)
        core.create_namespaced_pod(namespace, pod)
        if i < 4:  # keep creation order = scheduling order
            wait_for_phase(core, namespace, f"gpu-{i}", ("Running",))

    def unschedulable() -> dict | None:
        pod = pod_dict(core, namespace, "gpu-4")
        conds = {c["type"]: c for c in (pod or {}).get("status", {}).get("conditions") or []}
        c = conds.get("PodScheduled")
        return c if c and c["status"] == "False" and c.get("reason") == "Unschedulable" else None

    cond = wait_for(unschedulable, 30, what="gpu-4 Unschedulable")
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    time.sleep(2)  # still pending: nothing frees a GPU
    assert pod_dict(core, namespace, "gpu-4")["status"]["phase"] == "Pending"
    assert not pod_dict(core, namespace, "gpu-4")["spec"].get("nodeName")

    (tmp_path / "release-0").touch()  # one of the first four finishes
    assert wait_for_phase(core, namespace, "gpu-0")["status"]["phase"] == "Succeeded"
    t0 = time.monotonic()
    wait_for_phase(core, namespace, "gpu-4", ("Running", "Succeeded"), timeout=90)
    print(f"\n5th GPU pod scheduled {time.monotonic() - t0:.1f} s after a GPU pod succeeded")
    for i in range(1, 5):
        (tmp_path / f"release-{i}").touch()
    for i in range(5):
        assert wait_for_phase(core, namespace, f"gpu-{i}")["status"]["phase"] == "Succeeded"
        delete_and_wait(core, namespace, f"gpu-{i}")


@pytest.mark.parametrize(
    ("image", "reasons"),
    [
        ("registry.invalid/flare/pull-error:1", ("ErrImagePull", "ImagePullBackOff")),
        ("registry.invalid/flare/invalid-image:1", ("InvalidImageName",)),
        ("registry.invalid/flare/create-config-error:1", ("CreateContainerConfigError",)),
    ],
)
def test_injected_image_faults(
    core: k8s.CoreV1Api, namespace: str, tmp_path: pathlib.Path, image: str, reasons: tuple[str, ...]
) -> None:
    marker = tmp_path / "ran"
    core.create_namespaced_pod(namespace, python_pod("faulty", f"open({str(marker)!r}, 'w').close()", PY, image=image))
    seen = []
    for reason in reasons:
        pod = wait_for_waiting_reason(core, namespace, "faulty", (reason,))
        seen.append(reason)
        assert pod["status"]["phase"] == "Pending"
        assert container_state(pod)["waiting"].get("message")
    assert seen == list(reasons)
    time.sleep(0.5)
    assert not marker.exists(), "a faulty pod must never run"
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=faulty").items
    assert any(e.type == "Warning" for e in events)
    delete_and_wait(core, namespace, "faulty")  # never started: the agent confirms the deletion


def test_deleting_a_running_pod_kills_its_process(core: k8s.CoreV1Api, namespace: str) -> None:
    pod = {
        "metadata": {"name": "sleeper"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"]}],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    pid = _pid_of(wait_for_phase(core, namespace, "sleeper", ("Running",)))
    assert _alive(pid)
    took = delete_and_wait(core, namespace, "sleeper", grace=30)
    assert not _alive(pid)
    assert took < 10, f"SIGTERM should end sleep at once, took {took:.1f} s"


def test_sigterm_ignored_gets_sigkill_after_grace(core: k8s.CoreV1Api, namespace: str) -> None:
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    core.create_namespaced_pod(namespace, python_pod("stubborn", code, PY))
    pid = _pid_of(wait_for_phase(core, namespace, "stubborn", ("Running",)))
    wait_for(lambda: "ready" in read_log(core, namespace, "stubborn"), 10, what="handler installed")
    took = delete_and_wait(core, namespace, "stubborn", grace=2)
    assert not _alive(pid)
    assert 1.5 < took < 10, took


def test_memory_limit_gives_oomkilled(core: k8s.CoreV1Api, namespace: str) -> None:
    code = "import time\nblob = bytearray(300 * 1024 * 1024)\ntime.sleep(30)\n"
    core.create_namespaced_pod(
        namespace,
        python_pod("hog", code, PY, resources={"limits": {"memory": "100Mi"}, "requests": {"memory": "100Mi"}}),
    )
    pod = wait_for_phase(core, namespace, "hog", timeout=30)
    term = container_state(pod)["terminated"]
    assert pod["status"]["phase"] == "Failed"
    assert (term["exitCode"], term["reason"]) == (137, "OOMKilled")
    delete_and_wait(core, namespace, "hog")


def test_crash_loop_backoff_with_restart_policy(core: k8s.CoreV1Api, namespace: str) -> None:
    pod = python_pod("crashy", "import sys; sys.exit(1)", PY)
    pod["spec"]["restartPolicy"] = "OnFailure"
    core.create_namespaced_pod(namespace, pod)

    def crashlooping() -> dict | None:
        p = pod_dict(core, namespace, "crashy")
        st = (p or {}).get("status", {}).get("containerStatuses") or []
        if (
            st
            and st[0]["restartCount"] >= 1
            and (st[0]["state"].get("waiting") or {}).get("reason") == "CrashLoopBackOff"
        ):
            return p
        return None

    p = wait_for(crashlooping, 30, what="CrashLoopBackOff")
    assert p["status"]["phase"] == "Running"
    assert p["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 1
    delete_and_wait(core, namespace, "crashy")


def test_volumes_are_mapped_to_local_paths(
    core: k8s.CoreV1Api, namespace: str, tmp_path: pathlib.Path, node_agent: NodeAgent
) -> None:
    store = tmp_path / "store"
    host = tmp_path / "host"
    host.mkdir()
    (host / "input.txt").write_text("from the host\n")
    pv = create_local_volume(core, namespace, "flare-store", str(store))
    try:
        code = (
            "import os, sys\n"
            "uri = os.environ['STORE_URI']\n"
            "assert uri.startswith('file://'), uri\n"
            "open(uri[len('file://'):] + '/model.txt', 'w').write(open(sys.argv[1]).read().upper())\n"
            "open(os.environ['SCRATCH'] + '/x', 'w').write('scratch')\n"
            "print(os.getcwd())\n"
        )
        pod = python_pod(
            "mounts",
            code,
            PY,
            args=["/data/input.txt"],
            env=[{"name": "STORE_URI", "value": "file:///mnt/store"}, {"name": "SCRATCH", "value": "/scratch"}],
            volumeMounts=[
                {"name": "store", "mountPath": "/mnt/store"},
                {"name": "data", "mountPath": "/data", "readOnly": True},
                {"name": "scratch", "mountPath": "/scratch"},
            ],
            pod_spec={
                "volumes": [
                    {"name": "store", "persistentVolumeClaim": {"claimName": "flare-store"}},
                    {"name": "data", "hostPath": {"path": str(host), "type": "Directory"}},
                    {"name": "scratch", "emptyDir": {}},
                ]
            },
        )
        core.create_namespaced_pod(namespace, pod)
        done = wait_for_phase(core, namespace, "mounts")
        assert done["status"]["phase"] == "Succeeded", read_log(core, namespace, "mounts")
        assert (store / "model.txt").read_text() == "FROM THE HOST\n"
        assert str(node_agent.work_dir) in read_log(core, namespace, "mounts")
        delete_and_wait(core, namespace, "mounts")
    finally:
        core.delete_namespaced_persistent_volume_claim("flare-store", namespace)
        core.delete_persistent_volume(pv)


@pytest.mark.parametrize("deferrable", [False, True], ids=["sync", "deferrable"])
def test_stock_kubernetes_pod_operator(
    control_plane: ControlPlane, core: k8s.CoreV1Api, namespace: str, audit: AuditLog, deferrable: bool
) -> None:
    """The stock KPO runs a pod against the harness; the deferrable path runs its trigger inline."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk.exceptions import TaskDeferred

    mark = audit.mark()
    op = KubernetesPodOperator(
        task_id="kpo-hello",
        namespace=namespace,
        name="kpo-hello",
        image="python:3.11-slim",
        cmds=[PY, "-c", "import time; print('hello from a KPO pod', flush=True); time.sleep(2); print('bye')"],
        config_file=str(control_plane.kubeconfig),
        in_cluster=False,
        get_logs=True,
        on_finish_action="delete_pod",
        startup_timeout_seconds=60,
        poll_interval=1,
        startup_check_interval_seconds=1,
        random_name_suffix=True,
        deferrable=deferrable,
    )
    ti = SimpleNamespace(
        dag_id="harness",
        task_id="kpo-hello",
        map_index=-1,
        try_number=1,
        start_date=None,
        xcom_push=lambda *a, **k: None,
    )
    context = {"ti": ti, "task_instance": ti, "run_id": "manual__harness", "dag": SimpleNamespace(dag_id="harness")}
    t0 = time.monotonic()
    try:
        op.execute(context)  # raises on failure
        assert not deferrable, "a deferrable KPO must defer"
    except TaskDeferred as deferred:
        assert deferrable
        trigger, method = deferred.trigger, deferred.method_name

        async def first_event() -> object:
            async for event in trigger.run():
                return event
            raise AssertionError("trigger ended without an event")

        event = asyncio.run(first_event())
        assert event.payload["status"] == "success", event.payload
        getattr(op, method)(context, event.payload)  # trigger_reentry: logs, delete
    took = time.monotonic() - t0
    assert op.pod is not None
    name = op.pod.metadata.name
    wait_for(lambda: pod_dict(core, namespace, name) is None, 30, what="KPO pod deleted")
    audit.settle()
    reqs = audit.client_requests(namespace, since=mark)
    mode = "deferrable" if deferrable else "sync"
    print(
        f"\nAPI requests by the stock KubernetesPodOperator ({mode}) for one 2-s pod, {took:.1f} s in execute:\n"
        f"{format_summary(reqs)}"
    )
    agent = audit.requests(since=mark, namespace=namespace, users=[NODE_AGENT_USER])
    print(f"... and by the node agent for it:\n{format_summary(agent)}")
    assert any(r["verb"] == "create" and r["objectRef"].get("resource") == "pods" for r in reqs)
    assert any(r["objectRef"].get("subresource") == "log" for r in reqs)
    assert any(r["verb"] == "delete" and r["objectRef"].get("name") == name for r in reqs)


def test_no_container_process_left_behind(node_agent: NodeAgent) -> None:
    wait_for(lambda: not node_agent.running_processes(), 10, what="no container process running")
    assert not [pid for pid in node_agent.running_processes() if _alive(pid)]


LEAKY_TEST = """
import subprocess
import sys

from flare_airflow_testing.k8s.kube import python_pod, wait_for_phase


def test_leaves_a_pod_behind(core, namespace):
    core.create_namespaced_pod(namespace, python_pod("leaked", "print(1)", sys.executable))
    assert wait_for_phase(core, namespace, "leaked")["status"]["phase"] == "Succeeded"
"""


def test_namespace_fixture_fails_a_test_that_leaves_a_pod(tmp_path: pathlib.Path) -> None:
    """The per-test namespace fixture turns a leftover pod into a failure (inner pytest session,
    with its own control plane and node agent)."""
    repo = pathlib.Path(__file__).resolve().parents[3]
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "flare_airflow_testing.k8s.fixtures",
            "--rootdir",
            str(tmp_path),
            "--basetemp",
            str(tmp_path / "basetemp"),
            str(tmp_path / "test_leaky.py"),
        ],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "pods left in namespace" in out and "leaked (Succeeded)" in out, out
    assert "1 passed, 1 error" in out, out
