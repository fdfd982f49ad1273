"""Which store and host paths a pod may reach (flare_airflow.launchers.kubernetes.storage)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from flare_airflow.core.config import KubernetesLaunchSpec, ResourceSpec
from flare_airflow.launchers.kubernetes import (
    ALLOWED_HOST_PATHS_ENV,
    allowed_host_paths,
    build_pod,
    pod_to_dict,
    store_path_in_pod,
)
from flare_airflow.launchers.process import LaunchError
from tests.unit.launchers.kubernetes.pods import (
    SCHEMA_VERSION,
    STORE,
    _mounts,
    site_job,
)


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


def test_a_local_store_without_a_store_mount_is_refused() -> None:
    with pytest.raises(LaunchError, match="a local path the pod cannot see"):
        build_pod(site_job(), KubernetesLaunchSpec(image="x"), ResourceSpec(), store_root=STORE)
    with pytest.raises(LaunchError, match="a local path the pod cannot see"):
        build_pod(site_job(), KubernetesLaunchSpec(image="x"), ResourceSpec(), store_root=f"file://{STORE}")


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
