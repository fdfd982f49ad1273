"""KubernetesLauncher against the real control plane: pods built by ``build_pod``, bound by the real
kube-scheduler, run by the LOCAL NODE AGENT test harness, watched through ``map_pod``.

The trainer (``tests/integration/trainers/k8s_trainer.py``) is mounted into the pod from a hostPath
at /opt/trainer, and the model store through ``store_mount`` at /flare-store: the agent maps both
mount paths back to local paths, so what reaches the trainer is exactly what the pod spec says.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import time
import uuid
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from kubernetes import client as k8s

from flare_airflow.core.config import JobConfig, KubernetesLaunchSpec, ResourceSpec, TrainerSpec
from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.spec import JobReturnCode, JobState, SiteJob
from flare_airflow.core.store import ModelStore
from flare_airflow.launchers.kubernetes import KubernetesJobHandle, KubernetesLauncher, trainer_argv
from flare_airflow.site_task.spec import SiteRun
from flare_airflow_testing.k8s.audit import AuditLog, format_summary
from flare_airflow_testing.k8s.control_plane import ControlPlane
from flare_airflow_testing.k8s.kube import pod_dict, wait_for
from flare_airflow_testing.k8s.node_agent import NodeAgent

RC = JobReturnCode
TRAINERS = pathlib.Path(__file__).resolve().parents[1] / "trainers"
JOB, RUN = "demo", "manual__2025-05-01T10:00:00+00:00"
GLOBAL = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, dtype=np.float64)}


@pytest.fixture
def store(tmp_path: pathlib.Path) -> ModelStore:
    root = tmp_path / "store"
    root.mkdir()
    ms = ModelStore(root)
    write_artifact(ms.global_model(JOB, RUN, 0), FLModel(params=GLOBAL))
    return ms


class Sites:
    """Launches site jobs of one test: a launcher per spec, a SiteJob per site, pod/pid lookups."""

    def __init__(self, cp: ControlPlane, core: k8s.CoreV1Api, namespace: str, store: ModelStore) -> None:
        self.cp, self.core, self.namespace, self.store = cp, core, namespace, store
        self.handles: list[KubernetesJobHandle] = []

    def launcher(self, gpus: int = 0, **spec: Any) -> KubernetesLauncher:
        spec.setdefault("image", "registry.example.org/fl/trainer:1")
        spec.setdefault("store_mount", {"host_path": str(self.store.root), "mount_path": "/flare-store"})
        spec.setdefault("trainer_script", "/opt/trainer/k8s_trainer.py")
        self.spec = KubernetesLaunchSpec(
            namespace=self.namespace,
            trainer_command=[sys.executable],
            volumes=[{"name": "code", "mount_path": "/opt/trainer", "host_path": str(TRAINERS), "read_only": True}],
            poll_interval=0.5,
            **spec,
        )
        resources = ResourceSpec(num_of_gpus=gpus)
        return KubernetesLauncher(
            self.spec, resources, store_root=str(self.store.root), api_client=self.cp.api_client()
        )

    def job(self, site: str, *args: str, shutdown_timeout: float = 10.0) -> SiteJob:
        run = SiteRun(
            job=JOB,
            run_id=RUN,
            round=1,
            total_rounds=1,
            site=site,
            task="train",
            argv=[],
            global_model=f"file://{self.store.global_model(JOB, RUN, 0)}",
            output=str(self.store.site_update(JOB, RUN, 1, site)),
            shutdown_timeout=shutdown_timeout,
        )
        # Only the trainer block matters for the argv in the image.
        job = JobConfig.model_construct(trainer=TrainerSpec(script="train.py", args=list(args)))
        argv = tuple(trainer_argv(job, self.spec))
        return replace(run.site_job(), argv=argv)

    def launch(self, launcher: KubernetesLauncher, site: str, *args: str, **kw: Any) -> KubernetesJobHandle:
        handle = launcher.launch_job(self.job(site, *args, **kw))
        self.handles.append(handle)
        return handle

    def pod(self, handle: KubernetesJobHandle) -> dict[str, Any] | None:
        return pod_dict(self.core, self.namespace, handle.name)

    def gone(self, handle: KubernetesJobHandle) -> bool:
        return self.pod(handle) is None

    def cleanup(self) -> None:
        for handle in self.handles:
            handle.terminate()


@pytest.fixture
def sites(control_plane: ControlPlane, core: k8s.CoreV1Api, namespace: str, store: ModelStore, node_agent: NodeAgent):
    s = Sites(control_plane, core, namespace, store)
    try:
        yield s
    finally:
        s.cleanup()  # a failing test must not leave pods for the namespace fixture to complain about


def wait_running(handle: KubernetesJobHandle, timeout: float = 30) -> None:
    wait_for(lambda: handle.poll() is RC.UNKNOWN and handle.state is JobState.RUNNING, timeout, 0.2, f"{handle.name}")


def pid_of(pod: dict[str, Any]) -> int:
    """The agent puts the process id into the containerID: flare-node-agent://0.1/<pid>-<hex>."""
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    return int(cid.rsplit("/", 1)[1].split("-")[0])


def alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_a_site_job_runs_the_trainer_in_a_pod_and_sends_an_update(
    sites: Sites, core: k8s.CoreV1Api, namespace: str, audit: AuditLog
) -> None:
    value = f"s3cr3t-{uuid.uuid4().hex}"
    core.create_namespaced_secret(
        namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="creds"), string_data={"token": value})
    )
    launcher = sites.launcher(secret_env={"TOKEN": {"secret": "creds", "key": "token"}})
    mark = audit.mark()
    handle = sites.launch(launcher, "site-1", "--secret-env", "TOKEN")
    stored = sites.pod(handle)  # the pod as the API stores it
    assert stored is not None
    assert value not in json.dumps(stored)
    assert stored["metadata"]["labels"]["flare-airflow/site"] == "site-1"
    env = {e["name"]: e for e in stored["spec"]["containers"][0]["env"]}
    update = sites.store.site_update(JOB, RUN, 1, "site-1")
    assert env["FLARE_OUTPUT"]["value"] == f"/flare-store/{update.relative_to(sites.store.root)}"
    assert env["TOKEN"] == {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}

    assert handle.wait(timeout=60) is RC.SUCCESS, handle.reason
    assert (handle.state, handle.reason) == (JobState.SUCCEEDED, "")
    params, record = read_artifact(update)
    np.testing.assert_array_equal(params["w"], GLOBAL["w"] + 1)
    np.testing.assert_array_equal(params["b"], GLOBAL["b"] + 1)
    assert record.num_samples == 7
    logs = handle.logs()
    assert "site site-1 round 1" in logs and "update sent" in logs
    assert f"secret sha256 {hashlib.sha256(value.encode()).hexdigest()}" in logs
    assert value not in logs
    assert sites.gone(handle)  # deleted when it finished

    audit.settle()
    reqs = audit.client_requests(namespace, since=mark, pod=handle.name)
    print(f"\nAPI requests of one KubernetesLauncher site job (+1 get by the test):\n{format_summary(reqs)}")
    verbs = [(r["verb"], r["objectRef"].get("subresource")) for r in reqs]
    assert verbs.count(("create", None)) == 1
    assert verbs.count(("delete", None)) == 1
    assert verbs.count(("get", "log")) == 1


def test_a_trainer_exit_code_is_mapped_and_the_pod_deleted(sites: Sites) -> None:
    handle = sites.launch(sites.launcher(), "site-1", "--exit", "103")
    assert handle.wait(timeout=60) is RC.CONFIG_ERROR
    assert (handle.state, handle.reason) == (JobState.FAILED, "exit code 103 (CONFIG_ERROR)")
    assert "site site-1 round 1" in handle.logs()
    assert sites.gone(handle)


def hold_all_gpus(sites: Sites, tmp_path: pathlib.Path) -> list[KubernetesJobHandle]:
    launcher = sites.launcher(gpus=1)
    holders = []
    for i in range(4):
        holders.append(sites.launch(launcher, f"site-{i}", "--release", str(tmp_path / f"release-{i}")))
        wait_running(holders[-1])  # creation order = scheduling order
    return holders


def test_the_fifth_one_gpu_job_waits_for_a_free_gpu_and_then_runs(sites: Sites, tmp_path: pathlib.Path) -> None:
    holders = hold_all_gpus(sites, tmp_path)
    fifth = sites.launch(sites.launcher(gpus=1), "site-4", "--release", str(tmp_path / "release-4"))
    wait_for(lambda: fifth.poll() is RC.UNKNOWN and fifth.status.waiting_for_resources, 30, 0.2, "5th job waiting")
    assert fifth.state is JobState.STARTING
    assert "Insufficient nvidia.com/gpu" in fifth.status.reason
    assert fifth.reason == ""  # not finished
    time.sleep(1.5)
    assert fifth.poll() is RC.UNKNOWN and fifth.status.waiting_for_resources  # nothing freed a GPU

    (tmp_path / "release-0").touch()
    assert holders[0].wait(timeout=30) is RC.SUCCESS
    assert sites.gone(holders[0])
    wait_running(fifth, timeout=60)
    for i in range(1, 5):
        (tmp_path / f"release-{i}").touch()
    for handle in [*holders[1:], fifth]:
        assert handle.wait(timeout=30) is RC.SUCCESS, handle.reason
        assert sites.gone(handle)
    for i in range(5):
        assert read_artifact(sites.store.site_update(JOB, RUN, 1, f"site-{i}"))[1].num_samples == 7


def test_a_job_pending_for_a_gpu_beyond_pending_timeout_fails_and_its_pod_is_deleted(
    sites: Sites, tmp_path: pathlib.Path
) -> None:
    holders = hold_all_gpus(sites, tmp_path)
    t0 = time.monotonic()
    late = sites.launch(sites.launcher(gpus=1, pending_timeout=5), "site-4")
    assert late.wait(timeout=30) is RC.INFRASTRUCTURE_ERROR
    took = time.monotonic() - t0
    assert late.state is JobState.FAILED
    assert "Insufficient nvidia.com/gpu" in late.reason and "pending_timeout=5s" in late.reason
    assert 4 <= took < 15, took  # creationTimestamp has whole seconds: up to 1 s early
    assert sites.gone(late)
    assert all(h.poll() is RC.UNKNOWN for h in holders)  # the others keep running
    for i in range(4):
        (tmp_path / f"release-{i}").touch()
    assert [h.wait(timeout=30) for h in holders] == [RC.SUCCESS] * 4


def test_an_image_pull_error_fails_within_30_s_and_the_pod_is_deleted(sites: Sites) -> None:
    t0 = time.monotonic()
    handle = sites.launch(sites.launcher(image="registry.invalid/flare/pull-error:1"), "site-1")
    assert handle.wait(timeout=30) is RC.INFRASTRUCTURE_ERROR
    assert time.monotonic() - t0 < 30
    assert handle.state is JobState.FAILED
    assert handle.reason.startswith(("ErrImagePull: ", "ImagePullBackOff: ")), handle.reason
    assert "pull-error" in handle.reason
    assert handle.logs() == ""  # it never ran
    assert sites.gone(handle)


def test_a_volume_that_cannot_be_mounted_fails_fast(sites: Sites, tmp_path: pathlib.Path) -> None:
    # The store is mounted from a node path that does not exist (a node without the site's share).
    launcher = sites.launcher(store_mount={"host_path": str(tmp_path / "no-such-store")})
    t0 = time.monotonic()
    handle = sites.launch(launcher, "site-1")
    assert handle.wait(timeout=30) is RC.INFRASTRUCTURE_ERROR
    assert time.monotonic() - t0 < 15  # not the 120-s startup timeout
    assert handle.reason.startswith("FailedMount: "), handle.reason
    assert '"flare-store"' in handle.reason
    assert sites.gone(handle)


def test_terminate_deletes_a_running_pod_and_its_process(sites: Sites, tmp_path: pathlib.Path) -> None:
    handle = sites.launch(sites.launcher(), "site-1", "--release", str(tmp_path / "never"), shutdown_timeout=3)
    wait_running(handle)
    wait_for(lambda: "site site-1 round 1" in handle.logs(), 15, 0.2, "trainer started")
    pod = sites.pod(handle)
    assert pod is not None
    pid = pid_of(pod)
    assert alive(pid)
    t0 = time.monotonic()
    handle.terminate()
    assert time.monotonic() - t0 < 10  # SIGTERM ends the trainer; no wait for the grace period
    assert sites.gone(handle)
    assert not alive(pid)
    assert (handle.state, handle.poll()) == (JobState.TERMINATED, RC.ABORTED)
    assert handle.reason == "terminated: pod deleted on request"
    assert "site site-1 round 1" in handle.logs()
