"""Bad container site specs (``launcher_spec.container`` and what a container site asks for).

Each case is a job file with one change to a valid container site, loaded as ``flare-airflow
validate`` and every task process load them: the ConfigError names the file, the field and the
site, before any engine is asked.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from flare_airflow.core.config import load_job
from flare_airflow.core.errors import ConfigError
from tests.bad_inputs.cases import Case, assert_clear

REPO = pathlib.Path(__file__).resolve().parents[2]
INITIAL_MODEL = REPO / "examples" / "digits" / "initial_model.safetensors"
MAX_MESSAGE = 1500
DELETE = object()  # a key the case removes from the valid block

BASE: dict[str, Any] = {"image": "localhost/flare-airflow/trainer:1", "trainer_script": "/opt/trainer/trainer.py"}


@dataclass(frozen=True)
class Bad:
    """One change to the valid container site below."""

    container: dict[str, Any] = field(default_factory=dict)  # keys set in launcher_spec.container
    site: dict[str, Any] = field(default_factory=dict)  # keys set in the site entry
    job: dict[str, Any] = field(default_factory=dict)  # keys set at the job's top level


CASES: list[Case] = []
INPUTS: dict[str, Bad] = {}


def case(id: str, bad_input: str, error: str, **bad: Any) -> None:
    CASES.append(Case(id, "container", bad_input, error))
    INPUTS[id] = Bad(**bad)


case(
    "container-image-missing",
    "a container site without `image`",
    "a container site needs its trainer image: set launcher_spec.container.image",
    container={"image": DELETE},
)
case(
    "container-privileged",
    "`privileged: true` in the container block",
    "privileged: container sites never loosen the sandbox (a privileged container is root on the host)",
    container={"privileged": True},
)
case(
    "container-cap-add",
    "`cap_add: [SYS_ADMIN]` in the container block",
    "cap_add: container sites never loosen the sandbox (capabilities are all dropped)",
    container={"cap_add": ["SYS_ADMIN"]},
)
case(
    "container-root-user",
    '`user: "0:0"` (the trainer as root)',
    "user '0:0' is root: container sites run the trainer as a non-root uid:gid",
    container={"user": "0:0"},
)
case(
    "container-host-network",
    "`network: host` (the host's network namespace)",
    "launcher_spec.container.network (site 'site-1'): must be 'none' or 'bridge', got 'host'",
    container={"network": "host"},
)
case(
    "container-volume-outside-allowed",
    "a volume from `/home/alice` when the site allows only `/data`",
    "volume host_path /home/alice is not under the site's allowed_host_paths (/data)",
    container={"allowed_host_paths": ["/data"], "volumes": [{"host_path": "/home/alice", "mount_path": "/in"}]},
)
case(
    "container-volume-docker-socket",
    "a volume from `/var/run/docker.sock`",
    "host_path '/var/run/docker.sock' would expose the node's system directory /var/run",
    container={"allowed_host_paths": ["/data"], "volumes": [{"host_path": "/var/run/docker.sock", "mount_path": "/s"}]},
)
case(
    "container-gpus-beyond-devices",
    "`num_of_gpus: 2` on a site that lists one GPU device",
    "a site job asks for 2 GPU(s) (resource_spec.num_of_gpus) but the site's launcher_spec.container.gpu_devices "
    "lists 1",
    container={"gpu_devices": ["nvidia.com/gpu=0"]},
    site={"resource_spec": {"num_of_gpus": 2}, "resource_manager": {"type": "gpu", "num_of_gpus": 2}},
)
case(
    "container-engine-unknown",
    "`engine: lxc`",
    "launcher_spec.container.engine (site 'site-1'): must be 'podman' or 'docker', got 'lxc'",
    container={"engine": "lxc"},
)
case(
    "container-secret-in-env",
    "a secret value typed into `env` under a name also in `secret_env`",
    "TOKEN",
    container={"env": {"TOKEN": "x"}, "secret_env": {"TOKEN": {"variable": "tok"}}},
)


case(
    "container-sensor-object-store",
    "`watch: sensor` on a container site of a job whose store is `s3://`",
    "sites.site-1.watch: sensor cannot publish a container site's update to the object store 's3://flare/store': "
    "its job sees only the files its site task stages on the worker",
    site={"watch": "sensor"},
    job={"store": "s3://flare/store", "store_conn_id": "flare_store"},
)


def _job(bad: Bad) -> dict[str, Any]:
    block = {key: value for key, value in {**BASE, **bad.container}.items() if value is not DELETE}
    site = {"launcher": "container", "launcher_spec": {"container": block}, **bad.site}
    return {
        "job": "demo",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": str(INITIAL_MODEL),
        "trainer": {"script": "trainer.py"},
        "sites": {"site-1": site},
        **bad.job,
    }


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_container_spec(case: Case, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(INPUTS[case.id]), sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_job(path)
    message = str(info.value)
    assert str(path) in message, message
    assert "sites.site-1" in message, message  # the field, the site
    assert len(message) <= MAX_MESSAGE, message
    assert_clear(case, message)


def test_the_valid_base_site_loads(tmp_path: pathlib.Path) -> None:
    """The cases above fail because of their one change, not because the base is broken."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(Bad()), sort_keys=False))
    spec = load_job(path).sites["site-1"]
    assert (spec.launcher, spec.launcher_spec.container.network, spec.launcher_spec.container.user) == (
        "container",
        "none",
        "1000:1000",
    )
