"""The pod manifest (flare_airflow.launchers.kubernetes.manifest), validated offline and strictly
against the Kubernetes JSON schemas: security context, resources, env, volumes, argv, secrets."""

from __future__ import annotations

import json
import uuid

import kubernetes_validate
import pytest
from kubernetes import client as k8s

from flare_airflow.core.config import KubernetesLaunchSpec, ResourceSpec, TrainerSpec, job_from_dict
from flare_airflow.core.config.trainer import NvflareCompat
from flare_airflow.launchers.kubernetes import (
    CONTAINER_NAME,
    build_pod,
    job_pod,
    pod_labels,
    pod_name,
    pod_to_dict,
    trainer_argv,
)
from flare_airflow.launchers.process import LaunchError
from flare_airflow_testing.k8s.node_agent import expand_vars
from tests.unit.launchers.kubernetes.pods import (
    SCHEMA_VERSION,
    SPECS,
    STORE,
    _env_values,
    _mounts,
    _staging_job,
    built,
    site_job,
)


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
    # An NVFlare Client API script: the image's interpreter runs the compatibility runner, its module
    # resolved in the image (never a path of this host), then the script as given.
    nv = job.model_copy(
        update={"trainer": job.trainer.model_copy(update={"nvflare": NvflareCompat(params_exchange="pytorch")})}
    )
    runner = ["-m", "flare_airflow.core.nvflare.run", "--params-exchange", "pytorch", "--transfer", "FULL"]
    assert trainer_argv(nv, spec) == ["python", *runner, "examples/digits/trainer.py", "--alpha", "0.5"]
    assert trainer_argv(nv, custom)[:3] == ["torchrun", "--nproc-per-node=1", "-m"]
    assert pod["metadata"]["namespace"] == "fl"
    assert pod["metadata"]["labels"]["flare-airflow/try"] == "2"
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_a_pod_needs_an_image_and_an_argv() -> None:
    with pytest.raises(LaunchError, match=r"launcher_spec.k8s.image is not set"):
        build_pod(site_job(), KubernetesLaunchSpec(), ResourceSpec(), store_root=None)
    with pytest.raises(LaunchError, match="empty argv"):
        build_pod(site_job(argv=()), KubernetesLaunchSpec(image="x"), ResourceSpec(), store_root=None)


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
