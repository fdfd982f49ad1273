"""The Kubernetes launcher without a cluster: the manifest (validated against the Kubernetes JSON
schemas, offline and strict), pod names and labels, secrets, the pod-state table, and the handle's
lifecycle against a fake API."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from flare_airflow.core.config import KubernetesLaunchSpec, ResourceSpec, TrainerSpec, job_from_dict
from flare_airflow.core.spec import JobReturnCode, JobState, SiteJob
from flare_airflow.launchers.kubernetes import (
    ALLOWED_HOST_PATHS_ENV,
    CONTAINER_NAME,
    FAIL_FAST_REASONS,
    KubernetesLauncher,
    allowed_host_paths,
    build_pod,
    job_pod,
    map_pod,
    pod_labels,
    pod_name,
    pod_to_dict,
    store_path_in_pod,
    trainer_argv,
)
from flare_airflow.launchers.process import LaunchError, map_exit
from tests.k8s_harness.node_agent import expand_vars

RC = JobReturnCode
RFC1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
SCHEMA_VERSION = kubernetes_validate.latest_version()
STORE = "/srv/flare/store"


def site_job(**kw: Any) -> SiteJob:
    base: dict[str, Any] = {
        "job": "digits",
        "run_id": "manual__2025-05-01T10:00:00+00:00",
        "round": 3,
        "site": "site-1",
        "argv": ("python", "/opt/trainer/train.py", "--epochs", "2"),
        "env": {
            "FLARE_JOB": "digits",
            "FLARE_SITE": "site-1",
            "FLARE_ROUND": "3",
            "FLARE_GLOBAL_MODEL": f"file://{STORE}/digits/run/round-0002/global.safetensors",
            "FLARE_OUTPUT": f"{STORE}/digits/run/round-0003/sites/site-1.safetensors",
            "FLARE_HPARAMS": '{"lr": 0.1}',
        },
        "shutdown_timeout": 7.5,
    }
    base.update(kw)
    return SiteJob(**base)


SPECS: dict[str, dict[str, Any]] = {
    "minimal": {"image": "registry.example.org/fl/trainer:1"},
    "gpu": {
        "image": "registry.example.org/fl/trainer:1",
        "namespace": "fl-site-1",
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "volumes": {
        "image": "registry.example.org/fl/trainer@sha256:" + "a" * 64,
        "volumes": [
            {"name": "data", "mount_path": "/data", "pvc": "site-data", "read_only": True},
            {"name": "reference", "mount_path": "/reference", "host_path": "/srv/reference"},
            {"name": "scratch", "mount_path": "/scratch", "empty_dir": True},
        ],
        "store_mount": {"pvc": "flare-store"},
    },
    "secrets": {
        "image": "trainer:dev",
        "image_pull_policy": "Never",
        "image_pull_secrets": ["regcred"],
        "service_account_name": "fl-trainer",
        "env": {"OMP_NUM_THREADS": "4", "PRICE": "$(NOT_EXPANDED)"},
        "secret_env": {"HF_TOKEN": {"secret": "hf", "key": "token"}, "DB_PASSWORD": {"secret": "db", "key": "pw"}},
        "store_mount": {"host_path": STORE, "mount_path": "/mnt/store"},
    },
    "tolerations": {
        "image": "trainer:1",
        "tolerations": [
            {"operator": "Exists"},
            {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute", "tolerationSeconds": 30},
        ],
        "labels": {"team": "radiology", "example.org/cost-center": "fl-42"},
        "annotations": {"example.org/owner": "site admins <admins@example.org>"},
    },
}
RESOURCES = {
    "minimal": ResourceSpec(),
    "gpu": ResourceSpec(num_of_gpus=2, num_of_cpus=4, memory="16Gi"),
    "volumes": ResourceSpec(num_of_cpus=0.5, memory="512Mi"),
    "secrets": ResourceSpec(num_of_gpus=1),
    "tolerations": ResourceSpec(num_of_cpus=1.25),
}


def built(name: str, try_number: int = 1, **kw: Any) -> dict[str, Any]:
    spec = KubernetesLaunchSpec(**SPECS[name])
    # Sites without a store mount reach an object store (never the local STORE path).
    root = STORE if spec.store_mount is not None else "s3://flare-bucket/store"
    pod = build_pod(site_job(**kw), spec, RESOURCES[name], store_root=root, try_number=try_number)
    return pod_to_dict(pod)


# ---------------------------------------------------------------- the manifest


def test_the_schema_is_a_current_one() -> None:
    major, minor = (int(x) for x in SCHEMA_VERSION.split(".")[:2])
    assert (major, minor) >= (1, 33), SCHEMA_VERSION


@pytest.mark.parametrize("name", sorted(SPECS))
def test_manifests_validate_strictly_against_the_kubernetes_schema(name: str) -> None:
    manifest = built(name)
    kubernetes_validate.validate(manifest, SCHEMA_VERSION, strict=True)
    # The validator is not a rubber stamp: an unknown field or a wrong type is refused.
    broken = json.loads(json.dumps(manifest))
    broken["spec"]["containers"][0]["comand"] = ["typo"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSION, strict=True)
    broken = json.loads(json.dumps(manifest))
    broken["spec"]["securityContext"]["runAsUser"] = "1000"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_security_context_is_restrictive(name: str) -> None:
    spec = built(name)["spec"]
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (container,) = spec["containers"]
    ctx = container["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["privileged"] is False
    assert ctx["runAsNonRoot"] is True
    assert ctx["readOnlyRootFilesystem"] is True
    assert spec["restartPolicy"] == "Never"
    assert container["name"] == CONTAINER_NAME


def test_the_service_account_token_is_mounted_only_for_an_explicit_account() -> None:
    assert built("minimal")["spec"]["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in built("minimal")["spec"]
    secrets = built("secrets")["spec"]
    assert secrets["serviceAccountName"] == "fl-trainer"
    assert secrets["automountServiceAccountToken"] is True


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        (ResourceSpec(), None),
        (ResourceSpec(num_of_gpus=1), {"nvidia.com/gpu": "1"}),
        (
            ResourceSpec(num_of_gpus=8, num_of_cpus=16, memory="64Gi"),
            {"nvidia.com/gpu": "8", "cpu": "16", "memory": "64Gi"},
        ),
        (ResourceSpec(num_of_cpus=0.5), {"cpu": "500m"}),
        (ResourceSpec(num_of_cpus=1.25, memory="1.5G"), {"cpu": "1250m", "memory": "1.5G"}),
        (ResourceSpec(num_of_cpus=0.0001), {"cpu": "1m"}),
    ],
)
def test_resources_request_equals_limit(resources: ResourceSpec, expected: dict[str, str] | None) -> None:
    pod = build_pod(site_job(), KubernetesLaunchSpec(image="x"), resources, store_root=None)
    got = pod_to_dict(pod)["spec"]["containers"][0].get("resources")
    if expected is None:
        assert got is None
    else:
        assert got == {"requests": expected, "limits": expected}


def test_identity_env_and_policy_fields() -> None:
    pod = built("secrets", try_number=2)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == pod_name("digits", "site-1", 3, "manual__2025-05-01T10:00:00+00:00", 2)
    assert meta["namespace"] == "default"
    assert meta["labels"] == pod_labels("digits", "manual__2025-05-01T10:00:00+00:00", 3, "site-1", 2)
    assert meta["annotations"] == {"flare-airflow/run-id": "manual__2025-05-01T10:00:00+00:00"}
    (c,) = spec["containers"]
    assert c["image"] == "trainer:dev"
    assert c["imagePullPolicy"] == "Never"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["terminationGracePeriodSeconds"] == 8  # ceil(shutdown_timeout)
    env = {e["name"]: e for e in c["env"]}
    assert env["FLARE_SITE"]["value"] == "site-1"
    assert env["FLARE_HPARAMS"]["value"] == '{"lr": 0.1}'
    assert env["OMP_NUM_THREADS"]["value"] == "4"
    assert env["PYTHONUNBUFFERED"]["value"] == "1"
    # The store root is mounted at /mnt/store: both store variables point there, URI or path.
    assert env["FLARE_GLOBAL_MODEL"]["value"] == "/mnt/store/digits/run/round-0002/global.safetensors"
    assert env["FLARE_OUTPUT"]["value"] == "/mnt/store/digits/run/round-0003/sites/site-1.safetensors"
    assert spec["volumes"] == [
        {"name": "flare-scratch", "emptyDir": {}},
        {"name": "flare-store", "hostPath": {"path": STORE, "type": "Directory"}},
    ]
    assert c["volumeMounts"] == [
        {"name": "flare-scratch", "mountPath": "/tmp"},
        {
            "name": "flare-store",
            "mountPath": "/mnt/store/digits/run/round-0003/sites",
            "subPath": "digits/run/round-0003/sites",
        },
        {
            "name": "flare-store",
            "mountPath": "/mnt/store/digits/run/round-0002/global.json",
            "subPath": "digits/run/round-0002/global.json",
            "readOnly": True,
        },
        {
            "name": "flare-store",
            "mountPath": "/mnt/store/digits/run/round-0002/global.safetensors",
            "subPath": "digits/run/round-0002/global.safetensors",
            "readOnly": True,
        },
    ]
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}


def test_site_labels_and_annotations_are_kept_but_ours_win() -> None:
    meta = built("tolerations")["metadata"]
    assert meta["labels"]["team"] == "radiology"
    assert meta["labels"]["example.org/cost-center"] == "fl-42"
    assert meta["labels"]["flare-airflow/site"] == "site-1"
    assert meta["annotations"]["example.org/owner"] == "site admins <admins@example.org>"
    tolerations = built("tolerations")["spec"]["tolerations"]
    assert tolerations == [
        {"operator": "Exists"},
        {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute", "tolerationSeconds": 30},
    ]


def test_volumes_are_mounted_as_declared() -> None:
    spec = built("volumes")["spec"]
    assert spec["volumes"] == [
        {"name": "flare-scratch", "emptyDir": {}},
        {"name": "flare-store", "persistentVolumeClaim": {"claimName": "flare-store"}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "site-data"}},
        {"name": "reference", "hostPath": {"path": "/srv/reference", "type": "Directory"}},
        {"name": "scratch", "emptyDir": {}},
    ]
    assert spec["containers"][0]["volumeMounts"] == [
        {"name": "flare-scratch", "mountPath": "/tmp"},
        {
            "name": "flare-store",
            "mountPath": "/flare-store/digits/run/round-0003/sites",
            "subPath": "digits/run/round-0003/sites",
        },
        {
            "name": "flare-store",
            "mountPath": "/flare-store/digits/run/round-0002/global.json",
            "subPath": "digits/run/round-0002/global.json",
            "readOnly": True,
        },
        {
            "name": "flare-store",
            "mountPath": "/flare-store/digits/run/round-0002/global.safetensors",
            "subPath": "digits/run/round-0002/global.safetensors",
            "readOnly": True,
        },
        {"name": "data", "mountPath": "/data", "readOnly": True},
        {"name": "reference", "mountPath": "/reference"},
        {"name": "scratch", "mountPath": "/scratch"},
    ]


def test_argv_survives_the_kubelets_variable_expansion_exactly() -> None:
    argv = ("python", "t.py", "--price", "$5", "$(HOME)", "$$", '--cfg={"a": "$(X)"}', "a b", "")
    spec = KubernetesLaunchSpec(image="x", env={"PRICE": "$(HOME)$$"})
    pod = pod_to_dict(build_pod(site_job(argv=argv), spec, ResourceSpec(), store_root=None))
    (c,) = pod["spec"]["containers"]
    assert "args" not in c  # one exact argv: command, nothing for the image's entrypoint to add to
    env = {"HOME": "/home/trainer", "X": "expanded"}
    assert tuple(expand_vars(a, env) for a in c["command"]) == argv
    price = next(e["value"] for e in c["env"] if e["name"] == "PRICE")
    assert expand_vars(price, env) == "$(HOME)$$"


def test_secret_values_never_appear_in_the_pod() -> None:
    value = f"s3cr3t-{uuid.uuid4().hex}"
    secret = k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="hf"), string_data={"token": value})
    assert value in json.dumps(pod_to_dict(secret))  # what a leak would look like
    for name in SPECS:
        text = json.dumps(built(name))
        assert value not in text
        assert "s3cr3t" not in text
    env = built("secrets")["spec"]["containers"][0]["env"]
    refs = [e for e in env if "valueFrom" in e]
    assert {e["name"] for e in refs} == {"HF_TOKEN", "DB_PASSWORD"}
    assert all("value" not in e for e in refs)


def test_trainer_argv_and_job_pod_from_a_validated_job(tmp_path) -> None:
    (tmp_path / "init.safetensors").write_bytes(b"x")
    job = job_from_dict(
        {
            "job": "digits",
            "rounds": 2,
            "min_clients": 1,
            "initial_model": "init.safetensors",
            "trainer": {"script": "examples/digits/trainer.py", "args": ["--alpha", 0.5], "command": ["/venv/python"]},
            "sites": {
                "site-1": {
                    "launcher": "k8s",
                    "resource_spec": {"num_of_gpus": 1},
                    "resource_manager": {"type": "passthrough"},
                    "launcher_spec": {"k8s": {"image": "trainer:1", "namespace": "fl", "pending_timeout": 30}},
                }
            },
        },
        base_dir=str(tmp_path),
    )
    spec = job.sites["site-1"].launcher_spec.k8s
    # The worker's interpreter (trainer.command) means nothing in the image: python by default.
    assert trainer_argv(job, spec) == ["python", "examples/digits/trainer.py", "--alpha", "0.5"]
    # On the worker the same job runs its own command and the script resolved against the job file.
    assert trainer_argv(job) == ["/venv/python", str(tmp_path / "examples/digits/trainer.py"), "--alpha", "0.5"]
    custom = spec.model_copy(update={"trainer_command": ["torchrun", "--nproc-per-node=1"], "trainer_script": "/t.py"})
    other = job.model_copy(update={"trainer": TrainerSpec(script="x.py", args=["-v"])})
    assert trainer_argv(other, custom) == ["torchrun", "--nproc-per-node=1", "/t.py", "-v"]
    pod = pod_to_dict(job_pod(job, "site-1", site_job(argv=("ignored",)), store_root=None, try_number=2))
    assert pod["spec"]["containers"][0]["command"] == ["python", "examples/digits/trainer.py", "--alpha", "0.5"]
    assert pod["metadata"]["namespace"] == "fl"
    assert pod["metadata"]["labels"]["flare-airflow/try"] == "2"
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_store_paths_the_pod_cannot_reach_are_refused() -> None:
    assert store_path_in_pod("file:///a/b/c.st", "file:///a/b/", "/m") == "/m/c.st"
    assert store_path_in_pod("/a/b", "/a/b", "/m/") == "/m"
    with pytest.raises(LaunchError, match="not under the model store root"):
        store_path_in_pod("/a/bc/x", "/a/b", "/m")  # a sibling with a common prefix is outside
    with pytest.raises(LaunchError, match="mounts a file:// store"):
        store_path_in_pod("s3://bucket/x", "s3://bucket", "/m")
    spec = KubernetesLaunchSpec(image="x", store_mount={"pvc": "store"})
    with pytest.raises(LaunchError, match="not under the model store root"):
        build_pod(site_job(), spec, ResourceSpec(), store_root="/elsewhere")
    with pytest.raises(LaunchError, match="no store root"):
        build_pod(site_job(), spec, ResourceSpec(), store_root=None)
    # Without a store mount (object storage), the locations are passed as they are.
    env = pod_to_dict(build_pod(site_job(), KubernetesLaunchSpec(image="x"), ResourceSpec(), store_root=None))
    values = {e["name"]: e.get("value") for e in env["spec"]["containers"][0]["env"]}
    assert values["FLARE_OUTPUT"] == f"{STORE}/digits/run/round-0003/sites/site-1.safetensors"


def test_a_pod_needs_an_image_and_an_argv() -> None:
    with pytest.raises(LaunchError, match=r"launcher_spec.k8s.image is not set"):
        build_pod(site_job(), KubernetesLaunchSpec(), ResourceSpec(), store_root=None)
    with pytest.raises(LaunchError, match="empty argv"):
        build_pod(site_job(argv=()), KubernetesLaunchSpec(image="x"), ResourceSpec(), store_root=None)


# ---------------------------------------------------------------- names and labels

JOBS = st.from_regex(r"[a-z0-9]([-a-z0-9_]{0,48}[a-z0-9])?", fullmatch=True)
SITES = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
RUNS = st.text(min_size=1, max_size=250)


@settings(max_examples=300, deadline=None)
@given(job=JOBS, site=SITES, round_num=st.integers(0, 1000), run_id=RUNS, try_number=st.integers(0, 100))
def test_pod_names_are_short_rfc1123_stable_and_readable(job, site, round_num, run_id, try_number) -> None:
    name = pod_name(job, site, round_num, run_id, try_number)
    assert len(name) <= 63
    assert RFC1123.match(name), name
    assert name == pod_name(job, site, round_num, run_id, try_number)
    assert re.search(rf"-r{round_num}-[0-9a-f]{{8}}$", name), name
    readable = name.removeprefix("fl-").rsplit(f"-r{round_num}-", 1)[0]
    job_part = re.sub(r"_+", "-", job)
    room = 63 - len("fl--") - len(f"-r{round_num}-") - 8
    if len(job_part) + len(site) <= room:
        assert readable == f"{job_part}-{site}"
    else:  # shortened: job and site each keep a prefix of at least half the room (or all of it)
        assert readable.startswith(job_part[: min(len(job_part), room - room // 2)].strip("-"))
        assert site[: min(len(site), room // 2)].strip("-") in readable


@settings(max_examples=300, deadline=None)
@given(
    a=st.tuples(JOBS, SITES, st.integers(0, 50), RUNS, st.integers(1, 5)),
    b=st.tuples(JOBS, SITES, st.integers(0, 50), RUNS, st.integers(1, 5)),
)
def test_different_site_jobs_get_different_names(a, b) -> None:
    if a != b:
        assert pod_name(*a) != pod_name(*b)


def test_names_are_unique_across_run_round_site_and_try() -> None:
    jobs = ["digits", "a" * 50, "x_y"]
    # Sites that differ only past the part a long name keeps: the hash still tells them apart.
    sites = ["site-1", "site-2", "h" * 60 + "-01", "h" * 60 + "-02"]
    runs = ["manual__2025-01-01T00:00:00+00:00", "manual__2025-01-01T00:00:01+00:00", "a:b", "a_b", "scheduled__x"]
    combos = [(j, s, r, run, t) for j in jobs for s in sites for r in range(10) for run in runs for t in (1, 2, 3)]
    names = {pod_name(*c) for c in combos}
    assert len(names) == len(combos) == 1800


@settings(max_examples=300, deadline=None)
@given(job=JOBS, site=SITES, round_num=st.integers(0, 1000), run_id=RUNS, try_number=st.integers(1, 100))
def test_labels_are_valid_label_values(job, site, round_num, run_id, try_number) -> None:
    labels = pod_labels(job, run_id, round_num, site, try_number)
    assert labels["app.kubernetes.io/managed-by"] == "flare-airflow"
    assert labels["flare-airflow/round"] == str(round_num)
    assert labels["flare-airflow/try"] == str(try_number)
    assert (labels["flare-airflow/job"], labels["flare-airflow/site"]) == (job, site)
    for value in labels.values():
        assert len(value) <= 63 and LABEL_VALUE.match(value), value


def test_run_labels_keep_plain_run_ids_and_tell_look_alikes_apart() -> None:
    run = lambda r: pod_labels("j", r, 1, "s", 1)["flare-airflow/run"]  # noqa: E731
    assert run("nightly_42") == "nightly_42"
    assert run("a:b") != run("a_b") != run("a_b-9b4e6c6c")
    long = "manual__" + "x" * 100
    assert len(run(long)) <= 63 and run(long) != run(long + "y")
    assert run(":::") and LABEL_VALUE.match(run(":::"))


# ---------------------------------------------------------------- the state table

NOW = datetime(2025, 5, 1, 12, 0, 0, tzinfo=UTC)


def pod(
    phase: str | None = "Pending",
    *,
    age: float = 1.0,
    waiting: tuple[str, str] | None = None,
    running: bool = False,
    terminated: dict[str, Any] | None = None,
    last_terminated: dict[str, Any] | None = None,
    scheduled: tuple[str, str, str] | None = None,
    deleting: bool = False,
    reason: str | None = None,
    message: str | None = None,
    volumes: tuple[k8s.V1Volume, ...] = (),
    uid: str = "uid-1",
) -> k8s.V1Pod:
    state = k8s.V1ContainerState(
        waiting=k8s.V1ContainerStateWaiting(reason=waiting[0], message=waiting[1] or None) if waiting else None,
        running=k8s.V1ContainerStateRunning(started_at=NOW) if running else None,
        terminated=k8s.V1ContainerStateTerminated(**terminated) if terminated else None,
    )
    last = k8s.V1ContainerState(
        terminated=k8s.V1ContainerStateTerminated(**last_terminated) if last_terminated else None
    )
    statuses = None
    if waiting or running or terminated or last_terminated:
        statuses = [
            k8s.V1ContainerStatus(
                name=CONTAINER_NAME,
                image="x",
                image_id="",
                ready=running,
                restart_count=0,
                state=state,
                last_state=last,
            )
        ]
    conditions = None
    if scheduled:
        conditions = [
            k8s.V1PodCondition(type="PodScheduled", status=scheduled[0], reason=scheduled[1], message=scheduled[2])
        ]
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name="p",
            uid=uid,
            creation_timestamp=NOW - timedelta(seconds=age),
            deletion_timestamp=NOW if deleting else None,
        ),
        spec=k8s.V1PodSpec(containers=[k8s.V1Container(name=CONTAINER_NAME)], volumes=list(volumes) or None),
        status=k8s.V1PodStatus(
            phase=phase, container_statuses=statuses, conditions=conditions, reason=reason, message=message
        ),
    )


def mapped(p: k8s.V1Pod | None, events: tuple[Any, ...] = (), **kw: float):
    return map_pod(
        p, now=NOW, pending_timeout=kw.get("pending", 300), startup_timeout=kw.get("startup", 120), events=events
    )


UNSCHEDULABLE = ("False", "Unschedulable")


def test_a_vanished_pod_is_never_success() -> None:
    s = mapped(None)
    assert (s.state, s.return_code, s.done) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR, True)
    assert s.reason == "pod vanished (deleted or garbage-collected) before reporting a result"


@pytest.mark.parametrize("resource", ["cpu", "memory", "nvidia.com/gpu"])
def test_pending_for_lack_of_resources_waits_up_to_pending_timeout(resource: str) -> None:
    msg = f"0/1 nodes are available: 1 Insufficient {resource}."
    waiting = mapped(pod(age=299, scheduled=(*UNSCHEDULABLE, msg)), startup=10)
    assert (waiting.state, waiting.return_code, waiting.done) == (JobState.STARTING, RC.UNKNOWN, False)
    assert waiting.waiting_for_resources is True
    assert waiting.reason == msg
    failed = mapped(pod(age=301, scheduled=(*UNSCHEDULABLE, msg)))
    assert (failed.state, failed.return_code, failed.done) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR, True)
    assert failed.waiting_for_resources is False
    assert f"Insufficient {resource}" in failed.reason
    assert "pending_timeout=300s" in failed.reason


def test_pending_for_other_reasons_fails_after_startup_timeout() -> None:
    msg = "0/1 nodes are available: 1 node(s) didn't match node selector."
    early = mapped(pod(age=100, scheduled=(*UNSCHEDULABLE, msg)))
    assert (early.done, early.waiting_for_resources, early.state) == (False, False, JobState.STARTING)
    late = mapped(pod(age=121, scheduled=(*UNSCHEDULABLE, msg)))
    assert (late.state, late.return_code) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR)
    assert "startup_timeout=120s" in late.reason and "didn't match node selector" in late.reason
    creating = mapped(pod(age=121, waiting=("ContainerCreating", "")))
    assert creating.return_code is RC.INFRASTRUCTURE_ERROR
    assert creating.reason == "pod did not start within startup_timeout=120s: ContainerCreating"
    assert mapped(pod(age=119, waiting=("ContainerCreating", ""))).done is False
    assert mapped(pod(phase=None, age=0)).state is JobState.STARTING  # not even a phase yet


@pytest.mark.parametrize(("reason", "rc"), sorted(FAIL_FAST_REASONS.items()))
def test_image_config_and_crash_errors_fail_fast(reason: str, rc: JobReturnCode) -> None:
    phase = "Running" if reason == "CrashLoopBackOff" else "Pending"
    s = mapped(pod(phase, age=0.5, waiting=(reason, "what the kubelet said")))
    assert (s.state, s.return_code, s.done) == (JobState.FAILED, rc, True)
    assert s.reason == f"{reason}: what the kubelet said"
    assert rc is not RC.SUCCESS


def test_fail_fast_return_codes() -> None:
    assert FAIL_FAST_REASONS["ErrImagePull"] is RC.INFRASTRUCTURE_ERROR
    assert FAIL_FAST_REASONS["ImagePullBackOff"] is RC.INFRASTRUCTURE_ERROR
    assert FAIL_FAST_REASONS["InvalidImageName"] is RC.CONFIG_ERROR
    assert FAIL_FAST_REASONS["CreateContainerConfigError"] is RC.CONFIG_ERROR
    assert FAIL_FAST_REASONS["CrashLoopBackOff"] is RC.EXECUTION_ERROR


def event(reason: str, message: str, uid: str = "uid-1") -> k8s.CoreV1Event:
    return k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(name="e"),
        involved_object=k8s.V1ObjectReference(kind="Pod", name="p", uid=uid),
        reason=reason,
        message=message,
        type="Warning",
    )


def test_mount_failures_of_our_volumes_fail_fast() -> None:
    store = k8s.V1Volume(name="flare-store", host_path=k8s.V1HostPathVolumeSource(path="/nope", type="Directory"))
    token = k8s.V1Volume(name="kube-api-access-x1", projected=k8s.V1ProjectedVolumeSource(sources=[]))
    p = pod(age=2, waiting=("ContainerCreating", ""), volumes=(store, token))
    msg = 'MountVolume.SetUp failed for volume "flare-store" : hostPath type check failed: /nope is not a directory'
    s = mapped(p, (event("FailedMount", msg),))
    assert (s.state, s.return_code, s.done) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR, True)
    assert s.reason == f"FailedMount: {msg}"
    # The service-account token volume's transient warnings, other pods' events: keep waiting.
    transient = (
        'MountVolume.SetUp failed for volume "kube-api-access-x1" : object "ns"/"kube-root-ca.crt" not registered'
    )
    assert mapped(p, (event("FailedMount", transient),)).done is False
    assert mapped(p, (event("FailedMount", msg, uid="uid-of-an-older-pod"),)).done is False
    assert mapped(p, (event("BackOff", msg),)).done is False
    # Also when the message reaches the pod's status (a waiting message).
    in_status = pod(
        age=2,
        waiting=("ContainerCreating", "Unable to attach or mount volumes: unmounted volumes=[flare-store]"),
        volumes=(store,),
    )
    assert mapped(in_status).return_code is RC.INFRASTRUCTURE_ERROR


def test_running_and_succeeded() -> None:
    r = mapped(pod("Running", age=5000, running=True))  # no timeout once it runs
    assert (r.state, r.return_code, r.done, r.reason) == (JobState.RUNNING, RC.UNKNOWN, False, "")
    s = mapped(pod("Succeeded", terminated={"exit_code": 0, "reason": "Completed"}))
    assert (s.state, s.return_code, s.done, s.reason) == (JobState.SUCCEEDED, RC.SUCCESS, True, "")


@pytest.mark.parametrize(
    ("terminated", "rc", "reason"),
    [
        ({"exit_code": 1, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 1"),
        ({"exit_code": 3, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 3"),
        ({"exit_code": 9, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 9"),
        ({"exit_code": 101, "reason": "Error"}, RC.EXCEPTION, "exit code 101 (EXCEPTION)"),
        ({"exit_code": 102, "reason": "Error"}, RC.UNSAFE_COMPONENT, "exit code 102 (UNSAFE_COMPONENT)"),
        ({"exit_code": 103, "reason": "Error"}, RC.CONFIG_ERROR, "exit code 103 (CONFIG_ERROR)"),
        ({"exit_code": 104, "reason": "Error"}, RC.INFRASTRUCTURE_ERROR, "exit code 104 (INFRASTRUCTURE_ERROR)"),
        ({"exit_code": 127, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 127"),
        ({"exit_code": 137, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 137 (SIGKILL)"),
        ({"exit_code": 143, "reason": "Error"}, RC.EXECUTION_ERROR, "exit code 143 (SIGTERM)"),
        (
            {"exit_code": 137, "reason": "OOMKilled"},
            RC.EXECUTION_ERROR,
            "OOMKilled: the trainer exceeded its memory limit (exit code 137); raise resource_spec.memory",
        ),
        (
            {"exit_code": 128, "reason": "StartError", "message": "exec: not found"},
            RC.EXECUTION_ERROR,
            "exit code 128: StartError: exec: not found",
        ),
        (
            {"exit_code": 0, "reason": "Completed"},
            RC.EXECUTION_ERROR,
            "pod failed although the trainer exited 0 (Completed)",
        ),
    ],
)
def test_failed_pods_map_their_exit_code(terminated: dict[str, Any], rc: JobReturnCode, reason: str) -> None:
    s = mapped(pod("Failed", terminated=terminated))
    assert (s.state, s.return_code, s.done, s.reason) == (JobState.FAILED, rc, True, reason)


def test_exit_codes_map_like_the_process_backend() -> None:
    for code in range(1, 256):
        s = mapped(pod("Failed", terminated={"exit_code": code, "reason": "Error"}))
        assert s.return_code is map_exit(code, terminated=False)[1], code
        assert s.state is JobState.FAILED


def test_failed_without_a_trainer_exit() -> None:
    evicted = mapped(pod("Failed", reason="Evicted", message="The node was low on resource: memory."))
    assert (evicted.state, evicted.return_code) == (JobState.FAILED, RC.INFRASTRUCTURE_ERROR)
    assert evicted.reason == "pod failed before the trainer ran (Evicted: The node was low on resource: memory.)"
    assert mapped(pod("Failed")).reason == "pod failed before the trainer ran (no reason given)"
    # Only the last termination is known (the container is waiting again): it still counts.
    s = mapped(pod("Failed", waiting=("ContainerCreating", ""), last_terminated={"exit_code": 2, "reason": "Error"}))
    assert (s.return_code, s.reason) == (RC.EXECUTION_ERROR, "exit code 2")


def test_deletion_aborts_unfinished_pods_but_keeps_a_success() -> None:
    for p in (
        pod("Running", running=True, deleting=True),
        pod("Pending", deleting=True),
        pod("Failed", terminated={"exit_code": 143, "reason": "Error"}, deleting=True),
    ):
        s = mapped(p)
        assert (s.state, s.return_code, s.done) == (JobState.TERMINATED, RC.ABORTED, True)
        assert s.reason.startswith("pod deleted before it finished")
    assert mapped(pod("Succeeded", terminated={"exit_code": 0}, deleting=True)).state is JobState.SUCCEEDED


@pytest.mark.parametrize("phase", ["Unknown", "Evicting", ""])
def test_unknown_phases_are_never_success(phase: str) -> None:
    s = mapped(pod(phase or "Weird", running=True))
    assert (s.state, s.return_code, s.done) == (JobState.FAILED, RC.EXECUTION_ERROR, True)
    assert s.reason == f"unknown pod phase {phase or 'Weird'!r}"


# ---------------------------------------------------------------- the handle against a fake API


class FakeCore:
    """Just enough of CoreV1Api: pods by name, injected failures, a call log."""

    def __init__(self) -> None:
        self.pods: dict[str, k8s.V1Pod] = {}
        self.calls: list[str] = []
        self.read_failures: list[ApiException] = []
        self.create_error: ApiException | None = None
        self.log = "line 1\nline 2\n"
        self.on_delete = lambda name: self.pods.pop(name, None)

    def create_namespaced_pod(self, namespace: str, body: k8s.V1Pod, **kw: Any) -> k8s.V1Pod:
        self.calls.append("create")
        if self.create_error is not None:
            raise self.create_error
        body.metadata.uid = "uid-1"
        body.metadata.creation_timestamp = datetime.now(UTC)
        body.status = k8s.V1PodStatus(phase="Pending")
        self.pods[body.metadata.name] = body
        return body

    def read_namespaced_pod(self, name: str, namespace: str, **kw: Any) -> k8s.V1Pod:
        self.calls.append("read")
        if self.read_failures:
            raise self.read_failures.pop(0)
        if name not in self.pods:
            raise ApiException(status=404, reason="Not Found")
        return self.pods[name]

    def list_namespaced_event(self, namespace: str, **kw: Any) -> k8s.CoreV1EventList:
        self.calls.append("events")
        return k8s.CoreV1EventList(items=[])

    def read_namespaced_pod_log(self, name: str, namespace: str, **kw: Any) -> Any:
        self.calls.append("log")
        assert kw["_preload_content"] is False and kw["container"] == CONTAINER_NAME
        return type("Resp", (), {"data": self.log.encode()})()

    def delete_namespaced_pod(self, name: str, namespace: str, body: k8s.V1DeleteOptions, **kw: Any) -> None:
        self.calls.append(f"delete grace={body.grace_period_seconds}")
        assert body.preconditions.uid == "uid-1"
        self.on_delete(name)

    def set_phase(self, name: str, phase: str, **container: Any) -> None:
        p = self.pods[name]
        state = k8s.V1ContainerState(**container)
        p.status = k8s.V1PodStatus(
            phase=phase,
            container_statuses=[
                k8s.V1ContainerStatus(
                    name=CONTAINER_NAME, image="x", image_id="", ready=True, restart_count=0, state=state
                )
            ],
        )


def launcher(fake: FakeCore, **spec: Any) -> KubernetesLauncher:
    out = KubernetesLauncher(
        KubernetesLaunchSpec(image="x", namespace="fl", poll_interval=0.01, **spec),
        ResourceSpec(),
        api_client=k8s.ApiClient(),
    )
    out.core = fake  # type: ignore[assignment]
    return out


RUNNING = {"running": k8s.V1ContainerStateRunning(started_at=NOW)}
DONE = {"terminated": k8s.V1ContainerStateTerminated(exit_code=0, reason="Completed")}


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (422, "the API refused the pod"),
        (409, "a pod with this name already exists"),
        (403, "creating the pod failed (HTTP 403)"),
    ],
)
def test_launch_errors_carry_the_apis_message(status: int, expected: str) -> None:
    fake = FakeCore()
    fake.create_error = ApiException(status=status, reason="x")
    fake.create_error.body = json.dumps({"message": f'Pod "p" is invalid: spec.x: {status} from the API'})
    with pytest.raises(LaunchError) as info:
        launcher(fake).launch_job(site_job())
    assert expected in str(info.value)
    assert f"{status} from the API" in str(info.value)
    assert "digits/site-1/r3" in str(info.value)


def test_success_reads_the_log_and_deletes_the_pod() -> None:
    fake = FakeCore()
    lines: list[str] = []
    ln = launcher(fake)
    ln.sink = lines.append
    handle = ln.launch_job(site_job(), {"try_number": 4})
    assert handle.name.startswith("fl-digits-site-1-r3-") and handle.name == pod_name(
        "digits", "site-1", 3, site_job().run_id, 4
    )
    assert handle.poll() is RC.UNKNOWN and handle.state is JobState.STARTING
    fake.set_phase(handle.name, "Running", **RUNNING)
    assert handle.poll() is RC.UNKNOWN and handle.state is JobState.RUNNING
    fake.set_phase(handle.name, "Succeeded", **DONE)
    assert handle.wait(timeout=5) is RC.SUCCESS
    assert (handle.state, handle.reason) == (JobState.SUCCEEDED, "")
    assert handle.name not in fake.pods
    assert handle.logs() == "line 1\nline 2\n"  # kept after the deletion
    assert lines == ["[site-1 r3] line 1", "[site-1 r3] line 2"]
    assert fake.calls.count("log") == 1
    assert "delete grace=None" in fake.calls
    calls = len(fake.calls)
    assert handle.poll() is RC.SUCCESS and len(fake.calls) == calls  # final: no more API calls


def test_keep_pods_keeps_a_finished_pod() -> None:
    fake = FakeCore()
    handle = launcher(fake, keep_pods=True).launch_job(site_job())
    fake.set_phase(handle.name, "Failed", terminated=k8s.V1ContainerStateTerminated(exit_code=103, reason="Error"))
    assert handle.wait(timeout=5) is RC.CONFIG_ERROR
    assert handle.reason == "exit code 103 (CONFIG_ERROR)"
    assert handle.name in fake.pods
    assert not [c for c in fake.calls if c.startswith("delete")]


def test_transient_api_errors_are_retried_and_404_means_vanished() -> None:
    fake = FakeCore()
    handle = launcher(fake).launch_job(site_job())
    fake.set_phase(handle.name, "Running", **RUNNING)
    fake.read_failures = [ApiException(status=503, reason="Unavailable"), ApiException(status=500, reason="x")]
    assert handle.poll() is RC.UNKNOWN
    assert fake.calls.count("read") == 3
    fake.read_failures = [ApiException(status=403, reason="Forbidden")]  # not transient: raised at once
    with pytest.raises(ApiException):
        handle.poll()
    del fake.pods[handle.name]
    assert handle.poll() is RC.INFRASTRUCTURE_ERROR
    assert handle.reason == "pod vanished (deleted or garbage-collected) before reporting a result"
    assert not [c for c in fake.calls if c.startswith("delete")]


def test_terminate_deletes_with_the_shutdown_grace_and_waits_until_gone() -> None:
    fake = FakeCore()
    handle = launcher(fake).launch_job(site_job(shutdown_timeout=4.2))
    fake.set_phase(handle.name, "Running", **RUNNING)
    assert handle.poll() is RC.UNKNOWN
    reads_left = {"n": 3}

    def slow_delete(name: str) -> None:  # the pod stays for a few reads, as while its process stops
        def read_until_gone(n=name, ns="fl", **kw):
            fake.calls.append("read")
            reads_left["n"] -= 1
            if reads_left["n"] < 0:
                raise ApiException(status=404, reason="Not Found")
            return fake.pods[n]

        fake.read_namespaced_pod = read_until_gone  # type: ignore[method-assign]

    fake.on_delete = slow_delete
    handle.terminate()
    assert "delete grace=5" in fake.calls
    assert reads_left["n"] < 0  # waited until the API said the pod is gone
    assert (handle.state, handle.poll(), handle.reason) == (
        JobState.TERMINATED,
        RC.ABORTED,
        "terminated: pod deleted on request",
    )
    assert handle.logs() == "line 1\nline 2\n"
    handle.terminate()  # idempotent


def test_terminate_keeps_a_result_that_is_already_there() -> None:
    fake = FakeCore()
    handle = launcher(fake).launch_job(site_job())
    fake.set_phase(handle.name, "Succeeded", **DONE)
    handle.terminate()
    assert (handle.state, handle.poll()) == (JobState.SUCCEEDED, RC.SUCCESS)
    assert handle.name not in fake.pods


def test_wait_with_a_timeout_returns_unknown_while_pending() -> None:
    fake = FakeCore()
    handle = launcher(fake).launch_job(site_job())
    assert handle.wait(timeout=0.1) is RC.UNKNOWN
    assert handle.state is JobState.STARTING
    assert handle.name in fake.pods


def test_a_local_store_without_a_store_mount_is_refused() -> None:
    with pytest.raises(LaunchError, match="a local path the pod cannot see"):
        build_pod(site_job(), KubernetesLaunchSpec(image="x"), ResourceSpec(), store_root=STORE)
    with pytest.raises(LaunchError, match="a local path the pod cannot see"):
        build_pod(site_job(), KubernetesLaunchSpec(image="x"), ResourceSpec(), store_root=f"file://{STORE}")


# ---------------------------------------------------------------- read-only root, store mounts, host paths


def _mounts(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod["spec"]["containers"][0]["volumeMounts"])


def _env_values(pod: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_the_root_filesystem_is_read_only_with_a_scratch_dir_and_home_on_it() -> None:
    for name in SPECS:
        pod = built(name)
        assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
        assert {"name": "flare-scratch", "emptyDir": {}} in pod["spec"]["volumes"]
        assert {"name": "flare-scratch", "mountPath": "/tmp"} in _mounts(pod)
        assert _env_values(pod)["HOME"] == "/tmp"
    # A site that needs another HOME (on a volume of its own) says so.
    spec = KubernetesLaunchSpec(image="x", env={"HOME": "/home/trainer"})
    pod = pod_to_dict(build_pod(site_job(), spec, ResourceSpec(), store_root=None))
    assert _env_values(pod)["HOME"] == "/home/trainer"


def _staging_job(round_num: int = 3, try_number: int = 2) -> SiteJob:
    # The layout with per-try staging directories: the input global model of round r-1, the update
    # of this site and try under round r.
    run = f"{STORE}/digits/run"
    return site_job(
        round=round_num,
        env={
            "FLARE_SITE": "site-1",
            "FLARE_GLOBAL_MODEL": f"file://{run}/round-{round_num - 1:04d}/global.safetensors",
            "FLARE_OUTPUT": f"{run}/round-{round_num:04d}/staging/site-1/try-{try_number}/update.safetensors",
        },
    )


@pytest.mark.parametrize("mount_path", ["/flare-store", "/mnt/store/"])
def test_the_pod_mounts_its_input_read_only_and_only_its_own_output_read_write(mount_path: str) -> None:
    spec = KubernetesLaunchSpec(image="x", store_mount={"host_path": STORE, "mount_path": mount_path})
    pod = pod_to_dict(build_pod(_staging_job(), spec, ResourceSpec(), store_root=f"file://{STORE}/"))
    kubernetes_validate.validate(pod, SCHEMA_VERSION, strict=True)
    base = mount_path.rstrip("/")
    store = [m for m in _mounts(pod) if m["name"] == "flare-store"]
    # The input global model's two files (not its directory, which holds the previous round's
    # site updates), read-only; this try's own staging directory, read-write.
    assert store == [
        {
            "name": "flare-store",
            "mountPath": f"{base}/digits/run/round-0002/global.json",
            "subPath": "digits/run/round-0002/global.json",
            "readOnly": True,
        },
        {
            "name": "flare-store",
            "mountPath": f"{base}/digits/run/round-0002/global.safetensors",
            "subPath": "digits/run/round-0002/global.safetensors",
            "readOnly": True,
        },
        {
            "name": "flare-store",
            "mountPath": f"{base}/digits/run/round-0003/staging/site-1/try-2",
            "subPath": "digits/run/round-0003/staging/site-1/try-2",
        },
    ]
    # The Client API's paths are what they were with the whole store mounted, and each lies in its mount.
    env = _env_values(pod)
    assert env["FLARE_GLOBAL_MODEL"] == f"{base}/digits/run/round-0002/global.safetensors"
    assert env["FLARE_OUTPUT"] == f"{base}/digits/run/round-0003/staging/site-1/try-2/update.safetensors"
    assert env["FLARE_GLOBAL_MODEL"] == store[1]["mountPath"]
    assert str(env["FLARE_OUTPUT"]).startswith(store[2]["mountPath"] + "/")
    # No mount reaches the store root, another round or another site.
    assert all(m["subPath"].startswith("digits/run/round-000") for m in store)


def test_store_mount_edge_cases() -> None:
    spec = KubernetesLaunchSpec(image="x", store_mount={"pvc": "store"})
    # Input and output in one directory: one mount, writable (the output must be written).
    same = site_job(env={"FLARE_GLOBAL_MODEL": f"{STORE}/r/global.safetensors", "FLARE_OUTPUT": f"{STORE}/r/out.st"})
    store = [
        m
        for m in _mounts(pod_to_dict(build_pod(same, spec, ResourceSpec(), store_root=STORE)))
        if m["name"] == "flare-store"
    ]
    assert store == [{"name": "flare-store", "mountPath": "/flare-store/r", "subPath": "r"}]
    # Files at the store root: each file on its own.
    top = site_job(env={"FLARE_GLOBAL_MODEL": f"{STORE}/g.st", "FLARE_OUTPUT": f"{STORE}/a/o.st"})
    store = [
        m
        for m in _mounts(pod_to_dict(build_pod(top, spec, ResourceSpec(), store_root=STORE)))
        if m["name"] == "flare-store"
    ]
    assert store == [
        {"name": "flare-store", "mountPath": "/flare-store/a", "subPath": "a"},
        {"name": "flare-store", "mountPath": "/flare-store/g.st", "subPath": "g.st", "readOnly": True},
        {"name": "flare-store", "mountPath": "/flare-store/g.st.json", "subPath": "g.st.json", "readOnly": True},
    ]
    # No store variables: no part of the store is mounted at all.
    none = site_job(env={"FLARE_SITE": "site-1"})
    pod = pod_to_dict(build_pod(none, spec, ResourceSpec(), store_root=STORE))
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["flare-scratch"]
    # '..' could climb out of the mounted directory: refused before any pod exists.
    sneaky = site_job(env={"FLARE_GLOBAL_MODEL": f"{STORE}/a/../../etc/g.st", "FLARE_OUTPUT": f"{STORE}/a/o.st"})
    with pytest.raises(LaunchError, match=r"'\.' or '\.\.' components"):
        build_pod(sneaky, spec, ResourceSpec(), store_root=STORE)


def test_allowed_host_paths_come_from_the_workers_environment() -> None:
    assert allowed_host_paths({}) is None
    assert allowed_host_paths({ALLOWED_HOST_PATHS_ENV: ""}) == ()
    assert allowed_host_paths({ALLOWED_HOST_PATHS_ENV: "/data:/scratch/:"}) == ("/data", "/scratch")
    for bad in ("data", "/data/../etc", "/data/./x"):
        with pytest.raises(LaunchError, match=f"{ALLOWED_HOST_PATHS_ENV}=.*is not a plain absolute path"):
            allowed_host_paths({ALLOWED_HOST_PATHS_ENV: f"/ok:{bad}"})


def test_host_paths_outside_the_allow_list_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = KubernetesLaunchSpec(
        image="x",
        store_mount={"host_path": STORE},
        volumes=[{"name": "ref", "mount_path": "/reference", "host_path": "/data/reference", "read_only": True}],
    )

    def build() -> dict[str, Any]:
        return pod_to_dict(build_pod(site_job(), spec, ResourceSpec(), store_root=STORE))

    monkeypatch.delenv(ALLOWED_HOST_PATHS_ENV, raising=False)
    build()  # unset: only the system directories are refused (by validation)
    monkeypatch.setenv(ALLOWED_HOST_PATHS_ENV, f"/data:{STORE}")
    kubernetes_validate.validate(build(), SCHEMA_VERSION, strict=True)
    monkeypatch.setenv(ALLOWED_HOST_PATHS_ENV, "/data")
    with pytest.raises(LaunchError) as info:
        build()
    message = str(info.value)
    assert message.startswith("digits/site-1/r3: launcher_spec.k8s store_mount: ")
    assert f"store_mount: host_path {STORE} is not under a host path this site allows" in message
    assert f"{ALLOWED_HOST_PATHS_ENV}: /data" in message
    # A prefix is a directory, not a string prefix: /srv/flare allows /srv/flare/store, not /srv/flare-x.
    monkeypatch.setenv(ALLOWED_HOST_PATHS_ENV, "/srv/flare/sto:/data")
    with pytest.raises(LaunchError, match="store_mount: host_path"):
        build()
    monkeypatch.setenv(ALLOWED_HOST_PATHS_ENV, "/srv/flare")
    with pytest.raises(LaunchError, match=r"volume 'ref': host_path /data/reference is not under"):
        build()
    monkeypatch.setenv(ALLOWED_HOST_PATHS_ENV, "")
    with pytest.raises(LaunchError, match=r"allows \(FLARE_K8S_ALLOWED_HOST_PATHS: none\)"):
        build()
    # The job cannot widen it: its env is the pod's, not the worker's.
    widened = spec.model_copy(update={"env": {ALLOWED_HOST_PATHS_ENV: "/"}})
    with pytest.raises(LaunchError, match="is not under a host path this site allows"):
        build_pod(site_job(), widened, ResourceSpec(), store_root=STORE)
    # PVCs and emptyDirs are not host paths.
    monkeypatch.setenv(ALLOWED_HOST_PATHS_ENV, "")
    pvc = KubernetesLaunchSpec(
        image="x", store_mount={"pvc": "store"}, volumes=[{"name": "s", "mount_path": "/s", "empty_dir": True}]
    )
    build_pod(site_job(), pvc, ResourceSpec(), store_root=STORE)


def test_the_launcher_creates_the_output_directory_before_the_pod(tmp_path) -> None:
    # Otherwise the kubelet creates the subPath directory owned by root, unwritable for UID 1000.
    root = tmp_path / "store"
    job = _staging_job()
    env = {k: v.replace(STORE, str(root)) for k, v in job.env.items()}
    fake = FakeCore()
    ln = launcher(fake, store_mount={"pvc": "store"})
    ln.store_root = str(root)
    ln.launch_job(site_job(env=env))
    assert (root / "digits/run/round-0003/staging/site-1/try-2").is_dir()
    assert not (root / "digits/run/round-0002").exists(), "the input is the Airflow side's to write"
    assert fake.calls == ["create"]
