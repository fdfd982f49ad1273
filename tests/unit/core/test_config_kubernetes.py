"""The k8s launcher block: a validated model whose errors name the file, the field, the site and what is allowed."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from flare_airflow.core.config import KubernetesLaunchSpec, SecretRef, StoreMount, VolumeSpec, load_job
from flare_airflow.core.errors import ConfigError
from tests.config_lines import without_lines


@pytest.fixture
def job_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    # No trainer script: it lives in the image, and only process sites need it on the worker.
    (tmp_path / "init.safetensors").write_bytes(b"not checked by the config layer")
    return tmp_path


def k8s_job(site: dict | None = None, **k8s: object) -> dict:
    block = {"image": "registry.example.org/fl/trainer:1", **k8s}
    return {
        "job": "demo",
        "rounds": 2,
        "min_clients": 1,
        "initial_model": "init.safetensors",
        "trainer": {"script": "/opt/trainer/train.py", "args": ["--epochs", 1]},
        "sites": {"site-1": {"launcher": "k8s", "launcher_spec": {"k8s": block}, **(site or {})}},
    }


def load(job_dir: pathlib.Path, data: dict) -> object:
    path = job_dir / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_job(path)


def error(job_dir: pathlib.Path, data: dict) -> tuple[str, str]:
    path = job_dir / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_job(path)
    return str(path), without_lines(path, str(info.value))


def test_a_full_k8s_block_loads(job_dir) -> None:
    data = k8s_job(
        namespace="fl-site-1",
        kubernetes_conn_id="site1_cluster",
        image_pull_policy="Always",
        image_pull_secrets=["regcred"],
        service_account_name="fl-trainer",
        node_selector={"nvidia.com/gpu.product": "A100"},
        tolerations=[
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute", "tolerationSeconds": 60},
        ],
        labels={"team": "radiology"},
        annotations={"example.org/owner": "site admins"},
        env={"OMP_NUM_THREADS": "4"},
        secret_env={"HF_TOKEN": {"secret": "hf", "key": "token"}},
        volumes=[
            {"name": "data", "mount_path": "/data", "pvc": "site-data", "read_only": True},
            {"name": "scratch", "mount_path": "/scratch", "empty_dir": True},
        ],
        store_mount={"pvc": "flare-store"},
        trainer_command=["python", "-u"],
        pending_timeout=60,
        keep_pods=True,
    )
    data["sites"]["site-1"]["resource_spec"] = {"num_of_gpus": 1, "num_of_cpus": 2, "memory": "8Gi"}
    data["sites"]["site-1"]["resource_manager"] = {"type": "passthrough"}
    site = load(job_dir, data).sites["site-1"]
    spec = site.launcher_spec.k8s
    assert isinstance(spec, KubernetesLaunchSpec)
    assert site.launcher == "k8s"
    assert spec.namespace == "fl-site-1"
    assert spec.secret_env == {"HF_TOKEN": SecretRef(secret="hf", key="token")}
    assert spec.volumes[0] == VolumeSpec(name="data", mount_path="/data", pvc="site-data", read_only=True)
    assert spec.store_mount == StoreMount(mount_path="/flare-store", pvc="flare-store")
    assert spec.tolerations[1]["tolerationSeconds"] == 60
    assert (spec.pending_timeout, spec.startup_timeout, spec.poll_interval) == (60, 120, 2)
    assert spec.trainer_command == ["python", "-u"]


def test_defaults() -> None:
    spec = KubernetesLaunchSpec(image="x")
    assert spec.namespace == "default"
    assert spec.image_pull_policy == "IfNotPresent"
    assert (spec.kubernetes_conn_id, spec.in_cluster, spec.store_mount, spec.service_account_name) == (None,) * 4
    assert (spec.pending_timeout, spec.startup_timeout, spec.keep_pods) == (300, 120, False)


def test_the_kubernetes_alias_and_a_process_site_next_to_a_k8s_site(job_dir) -> None:
    data = k8s_job()
    data["sites"]["site-2"] = {"launcher": "kubernetes", "launcher_spec": {"kubernetes": {"image": "img:2"}}}
    data["sites"]["site-3"] = {}  # process: the trainer script must exist on the worker
    _, msg = error(job_dir, data)
    assert "trainer.script '/opt/trainer/train.py' does not exist" in msg
    del data["sites"]["site-3"]
    job = load(job_dir, data)
    assert job.sites["site-2"].launcher == "k8s"
    assert job.sites["site-2"].launcher_spec.k8s.image == "img:2"


def test_a_k8s_site_without_an_image(job_dir) -> None:
    data = k8s_job()
    del data["sites"]["site-1"]["launcher_spec"]
    path, msg = error(job_dir, data)
    assert f"{path}: sites.site-1 (site 'site-1'): a Kubernetes site needs its trainer image" in msg
    assert "launcher_spec.k8s.image" in msg
    # A process site may carry a k8s block without an image (e.g. from @default): not used there.
    data["sites"]["site-1"] = {"launcher": "process", "launcher_spec": {"k8s": {"namespace": "fl"}}}
    (job_dir / "opt").mkdir()
    data["trainer"]["script"] = "opt"
    _, msg = error(job_dir, data)
    assert "image" not in msg.replace(str(job_dir), "<job dir>")  # the temp dir's name may say anything


@pytest.mark.parametrize(
    ("k8s", "field", "expected"),
    [
        ({"namespace": "Team_A"}, "namespace", "namespace 'Team_A' is not an RFC 1123 label"),
        ({"image": "bad image"}, "image", "image 'bad image' is not a valid image reference: it is empty or contains"),
        (
            {"image": "Registry.io/FL/Trainer:1"},
            "image",
            "the repository 'FL/Trainer' must be lowercase ('fl/trainer')",
        ),
        ({"image": "trainer:-1"}, "image", "tag '-1' must be up to 128 letters"),
        ({"image": "trainer@sha256:abc"}, "image", "digest 'sha256:abc' must be sha256: followed by 64"),
        ({"image": "reg_istry.io/trainer:1"}, "image", "registry 'reg_istry.io' must be a host name"),
        ({"image": "fl//trainer"}, "image", "the repository 'fl//trainer' must be lowercase letters and digits"),
        ({"namespace": "kube-system"}, "namespace", "namespace 'kube-system' belongs to Kubernetes itself"),
        ({"image_pull_policy": "Sometimes"}, "image_pull_policy", "'IfNotPresent', 'Always' or 'Never'"),
        ({"image_pull_secrets": ["Reg_Cred"]}, "image_pull_secrets", "image pull secret 'Reg_Cred' is not"),
        ({"service_account_name": "SA"}, "service_account_name", "service account name 'SA' is not"),
        ({"node_selector": {"gpu": "a 100"}}, "node_selector", "node_selector[gpu] 'a 100' is not a valid label"),
        ({"labels": {"-bad": "x"}}, "labels", "label key '-bad' is not a valid key"),
        ({"labels": {"flare-airflow/site": "x"}}, "labels", "is set by flare-airflow"),
        ({"labels": {"app.kubernetes.io/managed-by": "me"}}, "labels", "is set by flare-airflow"),
        ({"annotations": {"a/b/c": "x"}}, "annotations", "annotation key 'a/b/c' is not a valid key"),
        ({"env": {"1X": "v"}}, "env", "'1X' is not a valid environment variable name"),
        ({"env": {"FLARE_SITE": "v"}}, "env", "'FLARE_SITE' is reserved"),
        ({"env": {"TOKEN": "v"}, "secret_env": {"TOKEN": {"secret": "s", "key": "k"}}}, "k8s", "TOKEN set in both"),
        ({"secret_env": {"TOKEN": "plain-value"}}, "secret_env", "never the value itself"),
        ({"secret_env": {"TOKEN": {"secret": "s"}}}, "secret_env.TOKEN.key", "required field is missing"),
        ({"secret_env": {"T": {"secret": "S!", "key": "k"}}}, "secret_env.T.secret", "secret name 'S!' is not"),
        ({"tolerations": [{"key": "k", "operator": "Maybe"}]}, "tolerations", "operator 'Maybe' is not one of"),
        ({"tolerations": [{"key": "k", "effect": "NoRun"}]}, "tolerations", "effect 'NoRun' is not one of"),
        ({"tolerations": [{"key": "k", "typo": 1}]}, "tolerations", "unknown key 'typo'; allowed keys: key,"),
        ({"tolerations": [{"operator": "Equal"}]}, "tolerations", "without a key must have operator Exists"),
        ({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}, "tolerations", "Exists takes no value"),
        (
            {"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}]},
            "tolerations",
            "tolerationSeconds applies only to effect NoExecute",
        ),
        ({"volumes": [{"name": "d", "mount_path": "/d"}]}, "volumes.0", "needs exactly one of pvc, host_path"),
        (
            {"volumes": [{"name": "d", "mount_path": "/d", "pvc": "c", "empty_dir": True}]},
            "volumes.0",
            "(got pvc, empty_dir)",
        ),
        (
            {"volumes": [{"name": "d", "mount_path": "data", "empty_dir": True}]},
            "mount_path",
            "must be a plain absolute",
        ),
        (
            {"volumes": [{"name": "d", "mount_path": "/", "empty_dir": True}]},
            "mount_path",
            "shadow the whole container",
        ),
        (
            {"volumes": [{"name": "d", "mount_path": "/etc/ssl", "empty_dir": True}]},
            "mount_path",
            "shadow the image's /etc",
        ),
        (
            {"volumes": [{"name": "d", "mount_path": "/var", "empty_dir": True}]},
            "mount_path",
            "shadow the image's /var/run",
        ),
        (
            {"volumes": [{"name": "d", "mount_path": "/lib64", "empty_dir": True}]},
            "mount_path",
            "shadow the image's /lib64",
        ),
        (
            {"volumes": [{"name": "d", "mount_path": "/tmp", "empty_dir": True}]},
            "mount_path",
            "the pod's scratch directory",
        ),
        (
            {"volumes": [{"name": "d", "mount_path": "/d", "host_path": "/"}]},
            "host_path",
            "would expose the node's root",
        ),
        (
            {"volumes": [{"name": "d", "mount_path": "/d", "host_path": "/var/run/docker.sock"}]},
            "host_path",
            "would expose the node's system directory /var/run to the trainer",
        ),
        (
            {"volumes": [{"name": "d", "mount_path": "/d", "host_path": "/var/lib"}]},
            "host_path",
            "would expose the node's system directory /var/lib/kubelet",
        ),
        ({"volumes": [{"name": "d", "mount_path": "/d", "host_path": "/data/../etc"}]}, "host_path", "no '..', '.'"),
        ({"store_mount": {"host_path": "/proc/1/root"}}, "store_mount.host_path", "system directory /proc"),
        ({"store_mount": {"pvc": "s", "mount_path": "/usr/share/store"}}, "store_mount.mount_path", "image's /usr"),
        (
            {
                "volumes": [{"name": "a", "mount_path": "/flare-store/x", "empty_dir": True}],
                "store_mount": {"pvc": "s"},
            },
            "k8s",
            "volume 'a': mount_path /flare-store/x overlaps store_mount.mount_path /flare-store",
        ),
        (
            {"volumes": [{"name": "a", "mount_path": "/a", "pvc": "s"}], "store_mount": {"pvc": "s"}},
            "k8s",
            "volume 'a' mounts the model store (or part of it) again",
        ),
        (
            {
                "volumes": [{"name": "a", "mount_path": "/a", "host_path": "/srv"}],
                "store_mount": {"host_path": "/srv/store"},
            },
            "k8s",
            "volume 'a' mounts the model store (or part of it) again",
        ),
        ({"volumes": [{"name": "flare-store", "mount_path": "/s", "empty_dir": True}]}, "name", "is reserved"),
        ({"volumes": [{"name": "flare-scratch", "mount_path": "/s", "empty_dir": True}]}, "name", "is reserved"),
        ({"volumes": [{"name": "d", "mount_path": "/d", "nfs": "x"}]}, "volumes.0.nfs", "allowed keys: name,"),
        (
            {
                "volumes": [
                    {"name": "a", "mount_path": "/x", "empty_dir": True},
                    {"name": "b", "mount_path": "/x/", "empty_dir": True},
                ]
            },
            "k8s",
            "mount_path '/x' is used twice",
        ),
        (
            {"volumes": [{"name": "a", "mount_path": "/flare-store", "empty_dir": True}], "store_mount": {"pvc": "s"}},
            "k8s",
            "mount_path '/flare-store' is used twice",
        ),
        ({"store_mount": {"mount_path": "/s"}}, "store_mount", "store_mount needs exactly one of pvc, host_path"),
        ({"store_mount": {"pvc": "s", "empty_dir": True}}, "store_mount.empty_dir", "unknown key 'empty_dir'"),
        ({"trainer_command": "python -u"}, "trainer_command", "not a string"),
        ({"trainer_command": []}, "trainer_command", "must not be empty"),
        ({"pending_timeout": 0}, "pending_timeout", "pending_timeout must be a number of seconds > 0"),
        ({"pending_timeout": float("inf")}, "pending_timeout", "pending_timeout must be a number of seconds > 0"),
        ({"startup_timeout": float("nan")}, "startup_timeout", "startup_timeout must be a number of seconds > 0"),
        ({"poll_interval": -1}, "poll_interval", "got -1"),
        ({"pending_timeout": True}, "pending_timeout", "got True"),
        ({"in_cluster": True, "config_file": "/k"}, "k8s", "in_cluster and config_file exclude each other"),
        ({"memory": "4Gi"}, "memory", "unknown key 'memory'; allowed keys: image, namespace,"),
    ],
)
def test_k8s_block_errors_name_file_field_site_and_what_is_allowed(job_dir, k8s, field, expected) -> None:
    path, msg = error(job_dir, k8s_job(**k8s))
    line = next((line for line in msg.splitlines() if expected in line), None)
    assert line is not None, msg
    assert line.strip().startswith(f"{path}: sites.site-1.launcher_spec.k8s"), line
    assert field in line.split("(site")[0], line
    assert "(site 'site-1')" in line


def test_k8s_sites_with_gpus_still_need_a_resource_manager(job_dir) -> None:
    data = k8s_job(site={"resource_spec": {"num_of_gpus": 1}})
    _, msg = error(job_dir, data)
    assert "declares no resource_manager" in msg
    data["sites"]["site-1"]["resource_manager"] = {"type": "passthrough"}
    assert load(job_dir, data).sites["site-1"].resource_spec.num_of_gpus == 1


def test_the_block_is_frozen() -> None:
    spec = KubernetesLaunchSpec(image="x")
    with pytest.raises(ValueError, match="frozen"):
        spec.namespace = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "image",
    [
        "x",
        "trainer:dev",
        "registry.example.org/fl/trainer:1.0",
        "localhost:5000/fl/trainer",
        "localhost/trainer:1",
        "registry.example.org:443/a/b/c__d-e.f:v1.2_3",
        "ghcr.io/org/trainer@sha256:" + "a" * 64,
        "ghcr.io/org/trainer:1@sha256:" + "0" * 64,
        "10.0.0.1:5000/trainer",
    ],
)
def test_valid_image_references(image: str) -> None:
    assert KubernetesLaunchSpec(image=image).image == image


def test_paths_are_normalised_and_plain_data_paths_pass() -> None:
    vol = VolumeSpec(name="d", mount_path="/data/", host_path="/srv/data/")
    assert (vol.mount_path, vol.host_path) == ("/data", "/srv/data")
    for path in ("/home/fl/data", "/mnt/nfs", "/var/data", "/opt/datasets", "/tmp/cache"):
        VolumeSpec(name="d", mount_path=path, empty_dir=True)
    for path in ("/home/fl/data", "/mnt/nfs", "/var/data", "/srv", "/scratch"):
        VolumeSpec(name="d", mount_path="/d", host_path=path)
