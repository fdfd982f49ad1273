"""Bad Kubernetes site specs (``launcher_spec.k8s`` and what a k8s site asks for) and what the user is told.

Most cases are job files with one change to a valid k8s site, loaded as ``flare-airflow validate``
and every task process load them: the ConfigError names the file, the field and the site. Cases
marked ``pod`` pass validation and are refused where the pod is built (``job_pod``, on the Airflow
worker): the site admin's host-path allow-list (``FLARE_K8S_ALLOWED_HOST_PATHS``) lives there,
and so does the model store the pod must reach. No cluster is needed: nothing here gets as far as
creating a pod.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import yaml

from flare_airflow.core.config import load_job
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.spec import SiteJob
from flare_airflow.launchers.kubernetes import ALLOWED_HOST_PATHS_ENV, job_pod
from flare_airflow.launchers.process import LaunchError
from tests.bad_inputs.cases import Case, assert_clear
from tests.config_lines import without_lines

REPO = pathlib.Path(__file__).resolve().parents[2]
INITIAL_MODEL = REPO / "examples" / "digits" / "initial_model.safetensors"
STORE = "/srv/flare/store"
MAX_MESSAGE = 1500
DELETE = object()  # a k8s key the case removes from the valid block

BASE_K8S: dict[str, Any] = {
    "image": "registry.example.org/fl/trainer:1.0",
    "namespace": "fl-site-1",
    "store_mount": {"host_path": STORE, "mount_path": "/flare-store"},
}


@dataclass(frozen=True)
class Bad:
    """One change to the valid k8s site below, and where it is refused."""

    k8s: dict[str, Any] = field(default_factory=dict)  # keys set in launcher_spec.k8s (DELETE removes one)
    site: dict[str, Any] = field(default_factory=dict)  # keys set in the site entry
    stage: Literal["validate", "pod"] = "validate"
    worker_env: dict[str, str] = field(default_factory=dict)  # the Airflow worker's environment (pod stage)
    store_root: str = STORE  # the model store as the worker sees it (pod stage)


CASES: list[Case] = []
INPUTS: dict[str, Bad] = {}


def case(id: str, bad_input: str, error: str, **bad: Any) -> None:
    CASES.append(Case(id, "kubernetes", bad_input, error))
    INPUTS[id] = Bad(**bad)


def volume(**kw: Any) -> dict[str, Any]:
    return {"volumes": [{"name": "data", "mount_path": "/data", **kw}]}


# --- the image ---------------------------------------------------------------------------------
case(
    "k8s-image-missing",
    "a k8s site without `image`",
    "a Kubernetes site needs its trainer image: set launcher_spec.k8s.image",
    k8s={"image": DELETE},
)
case("k8s-image-empty", "`image: ''`", "image '' is not a valid image reference: it is empty", k8s={"image": ""})
case(
    "k8s-image-space",
    "`image: 'fl/trainer 1.0'` (a space)",
    "image 'fl/trainer 1.0' is not a valid image reference: it is empty or contains spaces",
    k8s={"image": "fl/trainer 1.0"},
)
case(
    "k8s-image-uppercase",
    "`image: registry.example.org/FL/Trainer:1` (uppercase repository)",
    "the repository 'FL/Trainer' must be lowercase ('fl/trainer')",
    k8s={"image": "registry.example.org/FL/Trainer:1"},
)
case(
    "k8s-image-bad-tag",
    "`image: trainer:v1!` (a tag with '!')",
    "tag 'v1!' must be up to 128 letters, digits, '_', '.' or '-'",
    k8s={"image": "trainer:v1!"},
)
case(
    "k8s-image-bad-digest",
    "`image: trainer@sha256:1234` (a short digest)",
    "digest 'sha256:1234' must be sha256: followed by 64 lowercase hex digits",
    k8s={"image": "trainer@sha256:1234"},
)
case(
    "k8s-image-bad-registry",
    "`image: my_registry.org/trainer:1` ('_' in the registry host)",
    "registry 'my_registry.org' must be a host name with an optional :port",
    k8s={"image": "my_registry.org/trainer:1"},
)
case(
    "k8s-image-not-a-string",
    "`image: 42`",
    "launcher_spec.k8s.image (site 'site-1'): must be a string, got the number 42",
    k8s={"image": 42},
)
case(
    "k8s-image-pull-policy",
    "`image_pull_policy: Sometimes`",
    "image_pull_policy (site 'site-1'): must be 'IfNotPresent', 'Always' or 'Never'",
    k8s={"image_pull_policy": "Sometimes"},
)
case(
    "k8s-pull-secret-name",
    "`image_pull_secrets: [Reg_Cred]`",
    "image pull secret 'Reg_Cred' is not a Kubernetes object name",
    k8s={"image_pull_secrets": ["Reg_Cred"]},
)
case(
    "k8s-pull-secrets-string",
    "`image_pull_secrets: regcred` (a string, not a list)",
    "launcher_spec.k8s.image_pull_secrets (site 'site-1'): must be a list",
    k8s={"image_pull_secrets": "regcred"},
)

# --- where the pod runs ------------------------------------------------------------------------
case(
    "k8s-namespace-invalid",
    "`namespace: Team_A`",
    "namespace 'Team_A' is not an RFC 1123 label",
    k8s={"namespace": "Team_A"},
)
case(
    "k8s-namespace-kube-system",
    "`namespace: kube-system`",
    "namespace 'kube-system' belongs to Kubernetes itself; run site jobs in a namespace of their own",
    k8s={"namespace": "kube-system"},
)
case(
    "k8s-service-account-invalid",
    "`service_account_name: Trainer SA`",
    "service account name 'Trainer SA' is not a Kubernetes object name",
    k8s={"service_account_name": "Trainer SA"},
)
case(
    "k8s-node-selector-value",
    "`node_selector: {gpu: 'a 100'}`",
    "node_selector[gpu] 'a 100' is not a valid label value",
    k8s={"node_selector": {"gpu": "a 100"}},
)
case(
    "k8s-node-selector-key",
    "`node_selector: {-gpu: a100}`",
    "node_selector key '-gpu' is not a valid key",
    k8s={"node_selector": {"-gpu": "a100"}},
)
case(
    "k8s-toleration-operator",
    "a toleration with `operator: Maybe`",
    "toleration 0: operator 'Maybe' is not one of Exists, Equal",
    k8s={"tolerations": [{"key": "gpu", "operator": "Maybe"}]},
)
case(
    "k8s-toleration-seconds",
    "`tolerationSeconds` on a NoSchedule toleration",
    "toleration 0: tolerationSeconds applies only to effect NoExecute",
    k8s={"tolerations": [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 30}]},
)
case(
    "k8s-toleration-not-a-mapping",
    "`tolerations: [NoSchedule]`",
    "toleration 0 must be a mapping with keys key, operator, value, effect, tolerationSeconds",
    k8s={"tolerations": ["NoSchedule"]},
)
case(
    "k8s-label-reserved",
    "`labels: {flare-airflow/site: other}`",
    "label 'flare-airflow/site' is set by flare-airflow (job, run, round, site, try); choose another key",
    k8s={"labels": {"flare-airflow/site": "other"}},
)
case(
    "k8s-label-value-too-long",
    "a label value of 64 characters",
    "is not a valid label value: at most 63 letters",
    k8s={"labels": {"team": "x" * 64}},
)
case(
    "k8s-annotation-key",
    "`annotations: {a/b/c: x}`",
    "annotation key 'a/b/c' is not a valid key",
    k8s={"annotations": {"a/b/c": "x"}},
)
case(
    "k8s-unknown-key",
    "`memory: 4Gi` inside launcher_spec.k8s (belongs in resource_spec)",
    "unknown key 'memory'; allowed keys: image, namespace,",
    k8s={"memory": "4Gi"},
)
case(
    "k8s-in-cluster-and-config-file",
    "`in_cluster: true` and `config_file: /k/config`",
    "in_cluster and config_file exclude each other",
    k8s={"in_cluster": True, "config_file": "/k/config"},
)
case(
    "k8s-keep-pods-string",
    "`keep_pods: 'sometimes'`",
    "launcher_spec.k8s.keep_pods (site 'site-1'): must be true or false",
    k8s={"keep_pods": "sometimes"},
)

# --- environment and secrets -------------------------------------------------------------------
case(
    "k8s-env-name-equals",
    "`env: {'A=B': x}`",
    "'A=B' is not a valid environment variable name",
    k8s={"env": {"A=B": "x"}},
)
case(
    "k8s-env-reserved",
    "`env: {FLARE_OUTPUT: /elsewhere}`",
    "'FLARE_OUTPUT' is reserved",
    k8s={"env": {"FLARE_OUTPUT": "/elsewhere"}},
)
case(
    "k8s-env-value-number",
    "`env: {OMP_NUM_THREADS: 4}` (a number, not a string)",
    "launcher_spec.k8s.env.OMP_NUM_THREADS (site 'site-1'): must be a string, got the number 4",
    k8s={"env": {"OMP_NUM_THREADS": 4}},
)
case(
    "k8s-env-value-nul",
    '`env: {MODE: "a\\0b"}` (a NUL character)',
    "env.MODE contains a NUL character",
    k8s={"env": {"MODE": "a\0b"}},
)
case(
    "k8s-secret-value-inline",
    "`secret_env: {HF_TOKEN: hf_abc123}` (the value itself)",
    "secret_env.HF_TOKEN must be a reference {secret: <Secret name>, key: <key>}, never the value itself",
    k8s={"secret_env": {"HF_TOKEN": "hf_abc123"}},
)
case(
    "k8s-secret-key-missing",
    "`secret_env: {HF_TOKEN: {secret: hf}}` (no key)",
    "launcher_spec.k8s.secret_env.HF_TOKEN.key (site 'site-1'): required field is missing",
    k8s={"secret_env": {"HF_TOKEN": {"secret": "hf"}}},
)
case(
    "k8s-secret-name-invalid",
    "`secret_env: {HF_TOKEN: {secret: Hf_Token, key: token}}`",
    "secret name 'Hf_Token' is not a Kubernetes object name",
    k8s={"secret_env": {"HF_TOKEN": {"secret": "Hf_Token", "key": "token"}}},
)
case(
    "k8s-secret-key-invalid",
    "`secret_env: {HF_TOKEN: {secret: hf, key: a/b}}`",
    "secret key 'a/b' may contain only letters, digits, '-', '_' and '.'",
    k8s={"secret_env": {"HF_TOKEN": {"secret": "hf", "key": "a/b"}}},
)
case(
    "k8s-secret-extra-value",
    "`secret_env: {HF_TOKEN: {secret: hf, key: token, value: hf_abc}}`",
    "secret_env.HF_TOKEN.value (site 'site-1'): unknown key 'value'; allowed keys: secret, key",
    k8s={"secret_env": {"HF_TOKEN": {"secret": "hf", "key": "token", "value": "hf_abc"}}},
)
case(
    "k8s-secret-reserved-name",
    "`secret_env: {FLARE_SITE: {secret: s, key: k}}`",
    "secret_env: 'FLARE_SITE' is reserved",
    k8s={"secret_env": {"FLARE_SITE": {"secret": "s", "key": "k"}}},
)
case(
    "k8s-secret-and-env",
    "the same name in `env` and `secret_env`",
    "TOKEN set in both env and secret_env; keep one",
    k8s={"env": {"TOKEN": "x"}, "secret_env": {"TOKEN": {"secret": "s", "key": "k"}}},
)

# --- the model store in the pod ----------------------------------------------------------------
case(
    "k8s-store-mount-missing",
    "a file:// model store and no `store_mount`",
    "the model store /srv/flare/store is a local path the pod cannot see: set launcher_spec.k8s.store_mount",
    k8s={"store_mount": DELETE},
    stage="pod",
)
case(
    "k8s-store-mount-object-store",
    "`store_mount` with an s3:// model store",
    "FLARE_GLOBAL_MODEL: store_mount mounts a file:// store, but the model store is 's3://bucket/flare': "
    "leave store_mount out for an object store",
    stage="pod",
    store_root="s3://bucket/flare",
)
case(
    "k8s-store-mount-no-source",
    "`store_mount: {mount_path: /flare-store}` (no pvc or host_path)",
    "store_mount needs exactly one of pvc, host_path (got none)",
    k8s={"store_mount": {"mount_path": "/flare-store"}},
)
case(
    "k8s-store-mount-two-sources",
    "`store_mount` with both `pvc` and `host_path`",
    "store_mount needs exactly one of pvc, host_path (got pvc, host_path)",
    k8s={"store_mount": {"pvc": "store", "host_path": STORE}},
)
case(
    "k8s-store-mount-host-root",
    "`store_mount: {host_path: /}`",
    "host_path '/' would expose the node's root to the trainer",
    k8s={"store_mount": {"host_path": "/"}},
)
case(
    "k8s-store-mount-at-root",
    "`store_mount: {mount_path: /}`",
    "mount_path '/' would shadow the whole container filesystem",
    k8s={"store_mount": {"host_path": STORE, "mount_path": "/"}},
)
case(
    "k8s-store-mount-not-allowed",
    "the store's host_path outside the worker's FLARE_K8S_ALLOWED_HOST_PATHS=/data",
    "store_mount: host_path /srv/flare/store is not under a host path this site allows "
    "(FLARE_K8S_ALLOWED_HOST_PATHS: /data)",
    stage="pod",
    worker_env={ALLOWED_HOST_PATHS_ENV: "/data"},
)

# --- volumes and host paths --------------------------------------------------------------------
case(
    "k8s-host-path-root",
    "a volume with `host_path: /`",
    "host_path '/' would expose the node's root to the trainer",
    k8s=volume(host_path="/"),
)
case(
    "k8s-host-path-etc",
    "a volume with `host_path: /etc/kubernetes`",
    "host_path '/etc/kubernetes' would expose the node's system directory /etc",
    k8s=volume(host_path="/etc/kubernetes"),
)
case(
    "k8s-host-path-docker-socket",
    "a volume with `host_path: /var/run/docker.sock`",
    "host_path '/var/run/docker.sock' would expose the node's system directory /var/run",
    k8s=volume(host_path="/var/run/docker.sock"),
)
case(
    "k8s-host-path-containerd-socket",
    "a volume with `host_path: /run/containerd/containerd.sock`",
    "host_path '/run/containerd/containerd.sock' would expose the node's system directory /run",
    k8s=volume(host_path="/run/containerd/containerd.sock"),
)
case(
    "k8s-host-path-kubelet",
    "a volume with `host_path: /var/lib/kubelet/pods` (other pods' Secrets)",
    "would expose the node's system directory /var/lib/kubelet",
    k8s=volume(host_path="/var/lib/kubelet/pods"),
)
case(
    "k8s-host-path-above-system",
    "a volume with `host_path: /var` (holds /var/run)",
    "host_path '/var' would expose the node's system directory /var/run",
    k8s=volume(host_path="/var"),
)
case(
    "k8s-host-path-lib64",
    "a volume with `host_path: /lib64`",
    "host_path '/lib64' would expose the node's system directory /lib64",
    k8s=volume(host_path="/lib64"),
)
case(
    "k8s-host-path-dotdot",
    "a volume with `host_path: /data/../etc`",
    "host_path '/data/../etc' must be a plain absolute path: no '..'",
    k8s=volume(host_path="/data/../etc"),
)
case(
    "k8s-host-path-relative",
    "a volume with `host_path: data`",
    "host_path 'data' must be a plain absolute path",
    k8s=volume(host_path="data"),
)
case(
    "k8s-host-path-not-allowed",
    "a volume with `host_path: /home/alice` on a worker with FLARE_K8S_ALLOWED_HOST_PATHS=/data:/scratch",
    "volume 'data': host_path /home/alice is not under a host path this site allows "
    "(FLARE_K8S_ALLOWED_HOST_PATHS: /data, /scratch, /srv/flare/store)",
    k8s=volume(host_path="/home/alice"),
    stage="pod",
    worker_env={ALLOWED_HOST_PATHS_ENV: f"/data:/scratch:{STORE}"},
)
case(
    "k8s-host-path-lookalike-prefix",
    "a volume with `host_path: /database` when only /data is allowed",
    "volume 'data': host_path /database is not under a host path this site allows",
    k8s=volume(host_path="/database"),
    stage="pod",
    worker_env={ALLOWED_HOST_PATHS_ENV: f"/data:{STORE}"},
)
case(
    "k8s-allowed-host-paths-invalid",
    "the worker's FLARE_K8S_ALLOWED_HOST_PATHS=data (a relative entry)",
    "FLARE_K8S_ALLOWED_HOST_PATHS='data': 'data' is not a plain absolute path; the site admin must fix",
    stage="pod",
    worker_env={ALLOWED_HOST_PATHS_ENV: "data"},
)
case(
    "k8s-mount-path-root",
    "a volume with `mount_path: /`",
    "mount_path '/' would shadow the whole container filesystem",
    k8s={"volumes": [{"name": "data", "mount_path": "/", "pvc": "data"}]},
)
case(
    "k8s-mount-path-system",
    "a volume with `mount_path: /usr/lib/python3`",
    "mount_path '/usr/lib/python3' would shadow the image's /usr",
    k8s={"volumes": [{"name": "data", "mount_path": "/usr/lib/python3", "pvc": "data"}]},
)
case(
    "k8s-mount-path-scratch",
    "a volume with `mount_path: /tmp`",
    "mount_path '/tmp' is the pod's scratch directory",
    k8s={"volumes": [{"name": "data", "mount_path": "/tmp", "pvc": "data"}]},
)
case(
    "k8s-mount-path-in-store",
    "a volume mounted at /flare-store/other (inside the store mount)",
    "volume 'data': mount_path /flare-store/other overlaps store_mount.mount_path /flare-store",
    k8s={"volumes": [{"name": "data", "mount_path": "/flare-store/other", "pvc": "data"}]},
)
case(
    "k8s-volume-is-the-store",
    "a volume whose host_path is the store's (the whole store, read-write)",
    "volume 'data' mounts the model store (or part of it) again",
    k8s=volume(host_path=STORE),
)
case(
    "k8s-volume-no-source",
    "a volume with neither pvc, host_path nor empty_dir",
    "volume 'data' needs exactly one of pvc, host_path, empty_dir (got none)",
    k8s=volume(),
)
case(
    "k8s-volume-two-sources",
    "a volume with `pvc` and `empty_dir: true`",
    "volume 'data' needs exactly one of pvc, host_path, empty_dir (got pvc, empty_dir)",
    k8s=volume(pvc="data", empty_dir=True),
)
case(
    "k8s-volume-reserved-name",
    "a volume named flare-scratch",
    "volume name 'flare-scratch' is reserved for flare-airflow's own volumes",
    k8s={"volumes": [{"name": "flare-scratch", "mount_path": "/data", "empty_dir": True}]},
)
case(
    "k8s-volume-duplicate-mount",
    "two volumes at /data and /data/",
    "mount_path '/data' is used twice",
    k8s={
        "volumes": [
            {"name": "a", "mount_path": "/data", "empty_dir": True},
            {"name": "b", "mount_path": "/data/", "empty_dir": True},
        ]
    },
)
case(
    "k8s-volume-unknown-kind",
    "a volume with `nfs: server:/export`",
    "unknown key 'nfs'; allowed keys: name, mount_path, read_only, pvc, host_path, empty_dir",
    k8s=volume(nfs="server:/export"),
)

# --- resources and timeouts --------------------------------------------------------------------
case(
    "k8s-gpus-without-resource-manager",
    "`resource_spec: {num_of_gpus: 1}` and no resource_manager",
    "asks for 1 GPU(s) (resource_spec.num_of_gpus) but the site declares no resource_manager",
    site={"resource_spec": {"num_of_gpus": 1}},
)
case(
    "k8s-gpus-more-than-site",
    "4 GPUs per job on a site with `resource_manager: {type: gpu, num_of_gpus: 2}`",
    "a site job asks for 4 GPUs but the site has only 2",
    site={"resource_spec": {"num_of_gpus": 4}, "resource_manager": {"type": "gpu", "num_of_gpus": 2}},
)
case(
    "k8s-gpus-times-nodes-more-than-site",
    "`nodes: 2` with 2 GPUs per pod on a site with `resource_manager: {type: gpu, num_of_gpus: 3}`",
    "a site job asks for 4 GPUs (2 per node x 2 nodes) but the site has only 3",
    k8s={"nodes": 2},
    site={"resource_spec": {"num_of_gpus": 2}, "resource_manager": {"type": "gpu", "num_of_gpus": 3}},
)
case(
    "k8s-nodes-zero",
    "`nodes: 0`",
    "nodes (site 'site-1'): must be greater than or equal to 1, got 0",
    k8s={"nodes": 0},
)
case(
    "k8s-master-port-low",
    "`master_port: 80` (a privileged port)",
    "master_port (site 'site-1'): must be greater than or equal to 1024, got 80",
    k8s={"nodes": 2, "master_port": 80},
)
case(
    "k8s-rank-in-env",
    "`env: {MASTER_ADDR: 10.0.0.1}` (set per pod by flare-airflow)",
    "MASTER_ADDR is set by flare-airflow for each pod of a multi-node site job",
    k8s={"env": {"MASTER_ADDR": "10.0.0.1"}},
)
case(
    "k8s-memory-quantity",
    "`resource_spec: {memory: 16GB}`",
    "'16GB' is not a quantity like '512Mi', '4Gi' or '2G'",
    site={"resource_spec": {"memory": "16GB"}},
)
case(
    "k8s-pending-timeout-inf",
    "`pending_timeout: .inf`",
    "pending_timeout must be a number of seconds > 0",
    k8s={"pending_timeout": math.inf},
)
case(
    "k8s-pending-timeout-nan",
    "`pending_timeout: .nan`",
    "pending_timeout must be a number of seconds > 0",
    k8s={"pending_timeout": math.nan},
)
case(
    "k8s-pending-timeout-negative",
    "`pending_timeout: -5`",
    "pending_timeout must be a number of seconds > 0",
    k8s={"pending_timeout": -5},
)
case(
    "k8s-pending-timeout-bool",
    "`pending_timeout: true`",
    "pending_timeout must be a number of seconds > 0 and <= 31622400 (366 days), got True",
    k8s={"pending_timeout": True},
)
case(
    "k8s-startup-timeout-zero",
    "`startup_timeout: 0`",
    "startup_timeout must be a number of seconds > 0",
    k8s={"startup_timeout": 0},
)
case(
    "k8s-poll-interval-huge",
    "`poll_interval: 1e12`",
    "poll_interval must be a number of seconds > 0 and <= 31622400 (366 days), got 1000000000000.0",
    k8s={"poll_interval": 1e12},
)

# --- the trainer in the image ------------------------------------------------------------------
case(
    "k8s-trainer-command-string",
    "`trainer_command: 'python -u'` (a shell string)",
    "must be a list of arguments, not a string (arguments are never run through a shell)",
    k8s={"trainer_command": "python -u"},
)
case(
    "k8s-trainer-command-empty",
    "`trainer_command: []`",
    "must not be empty (leave it out for the default ['python'])",
    k8s={"trainer_command": []},
)
case(
    "k8s-trainer-script-nul",
    '`trainer_script: "/opt/t.py\\0x"` (a NUL character)',
    "trainer_script contains a NUL character",
    k8s={"trainer_script": "/opt/t.py\0x"},
)
case(
    "k8s-trainer-script-blank",
    "`trainer_script: '  '`",
    "launcher_spec.k8s.trainer_script (site 'site-1'): must not be empty",
    k8s={"trainer_script": "  "},
)


def _job(bad: Bad) -> dict[str, Any]:
    k8s = {**BASE_K8S, **bad.k8s}
    k8s = {key: value for key, value in k8s.items() if value is not DELETE}
    site = {"launcher": "k8s", "launcher_spec": {"k8s": k8s}, **bad.site}
    return {
        "job": "demo",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": str(INITIAL_MODEL),
        "trainer": {"script": "/opt/trainer/train.py"},
        "sites": {"site-1": site},
    }


def _site_job(store_root: str) -> SiteJob:
    run = f"{store_root.rstrip('/')}/demo/manual__1"
    return SiteJob(
        job="demo",
        run_id="manual__1",
        round=1,
        site="site-1",
        argv=("python",),
        env={
            "FLARE_GLOBAL_MODEL": f"{run}/round-0000/global.safetensors",
            "FLARE_OUTPUT": f"{run}/round-0001/sites/site-1.safetensors",
        },
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_kubernetes_spec(case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = INPUTS[case.id]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(bad), sort_keys=False))
    monkeypatch.delenv(ALLOWED_HOST_PATHS_ENV, raising=False)
    if bad.stage == "validate":
        with pytest.raises(ConfigError) as info:
            load_job(path)
        message = without_lines(path, str(info.value))
        assert f"{path}: sites.site-1" in message, message  # the file, the field, the site
    else:
        job = load_job(path)  # valid as a job: the worker's policy or store refuses it
        for name, value in bad.worker_env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(LaunchError) as info:
            job_pod(job, "site-1", _site_job(bad.store_root), store_root=bad.store_root)
        message = str(info.value)
        assert "site-1" in message, message
    assert_clear(case, message)
    assert len(message) <= MAX_MESSAGE, message


def test_the_valid_base_site_builds_a_pod(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases above fail because of their one change, not because the base is broken."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(Bad()), sort_keys=False))
    monkeypatch.setenv(ALLOWED_HOST_PATHS_ENV, f"/data:{STORE}")
    pod = job_pod(load_job(path), "site-1", _site_job(STORE), store_root=STORE)
    assert pod.spec.containers[0].image == BASE_K8S["image"]
