"""Job configuration: every bad input is a ConfigError naming the file, the field, the site, what is allowed."""

from __future__ import annotations

import copy
import pathlib
import re

import pytest
import yaml

from flare_airflow.core.config import JobConfig, job_from_dict, load_job
from flare_airflow.core.errors import ConfigError
from tests.config_lines import without_lines

REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def job_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory with the files a job refers to: a trainer script and an initial model."""
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "init.safetensors").write_bytes(b"not checked by the config layer")
    return tmp_path


def base_job() -> dict:
    return {
        "job": "demo",
        "rounds": 3,
        "min_clients": 2,
        "initial_model": "init.safetensors",
        "trainer": {"script": "train.py", "args": ["--seed", "0"]},
        "sites": {"site-1": {}, "site-2": {}},
    }


def write_job(job_dir: pathlib.Path, data: dict | str, name: str = "job.yaml") -> pathlib.Path:
    path = job_dir / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def load_error(job_dir: pathlib.Path, data: dict | str) -> tuple[pathlib.Path, str]:
    path = write_job(job_dir, data)
    with pytest.raises(ConfigError) as info:
        load_job(path)
    return path, without_lines(path, str(info.value))


def test_shipped_digits_job_validates() -> None:
    job = load_job(REPO / "dags" / "digits.yaml")
    assert job.job == "digits"
    assert list(job.sites) == ["site-1", "site-2", "site-3", "site-4"]
    assert job.min_clients == 3
    assert job.rounds == 5
    # @default is folded into every site.
    assert {s.retries for s in job.sites.values()} == {1}
    assert {s.launcher for s in job.sites.values()} == {"process"}
    assert job.script_path() == (REPO / "examples" / "digits" / "trainer.py").resolve()
    assert job.initial_model_path().is_file()
    assert job.trainer.args == ["--num-sites", "4", "--alpha", "0.5", "--seed", "0"]


def test_minimal_job_loads_with_paths_relative_to_the_file(job_dir: pathlib.Path, tmp_path_factory) -> None:
    path = write_job(job_dir, base_job())
    elsewhere = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(elsewhere)
        job = load_job(path)
    assert job.script_path() == job_dir.resolve() / "train.py"
    assert job.initial_model_path() == job_dir.resolve() / "init.safetensors"
    assert job.site_weights() == {"site-1": 1.0, "site-2": 1.0}
    assert job.sites["site-1"].retries == 0


def test_malformed_yaml_names_file_and_line(job_dir: pathlib.Path) -> None:
    path, msg = load_error(job_dir, "job: demo\nrounds: 3\n  min_clients: 1\nsites: [site-1]\n")
    assert msg.startswith(f"{path}:3:"), msg
    assert "malformed YAML" in msg


def test_duplicate_keys_are_refused_not_silently_overwritten(job_dir: pathlib.Path) -> None:
    path, msg = load_error(job_dir, "job: demo\nrounds: 3\nrounds: 5\nmin_clients: 1\nsites: [site-1]\n")
    assert msg.startswith(f"{path}:3:"), msg
    assert "duplicate key 'rounds'" in msg


def test_unreadable_and_non_mapping_files(job_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read the job file"):
        load_job(job_dir / "missing.yaml")
    path, msg = load_error(job_dir, "- just\n- a list\n")
    assert msg.startswith(str(path))
    assert "must be a YAML mapping" in msg
    with pytest.raises(ConfigError, match="must be a mapping"):
        job_from_dict(["not", "a", "mapping"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mutate", "field", "site", "allowed"),
    [
        pytest.param(
            lambda d: d.update(roundz=3),
            "roundz",
            None,
            ["job", "rounds", "min_clients", "trainer", "sites", "resource_spec", "launcher_spec"],
            id="top-level",
        ),
        pytest.param(
            lambda d: d["trainer"].update(scirpt="x.py"),
            "trainer.scirpt",
            None,
            ["script", "args", "command", "hparams", "launch_timeout", "shutdown_timeout", "timeout"],
            id="trainer",
        ),
        pytest.param(
            lambda d: d["sites"]["site-2"].update(retires=2),
            "sites.site-2.retires",
            "site-2",
            ["launcher", "weight", "retries", "retry_delay_seconds", "resource_spec", "launcher_spec"],
            id="site",
        ),
        pytest.param(
            lambda d: d["sites"]["site-1"].update(resource_spec={"gpus": 1}),
            "sites.site-1.resource_spec.gpus",
            "site-1",
            ["num_of_gpus", "num_of_cpus", "memory", "mem_per_gpu_in_GiB"],
            id="resource_spec",
        ),
        pytest.param(
            lambda d: d["sites"].update({"@default": {"resource_spec": {"num_gpus": 1}}}),
            "sites.site-1.resource_spec.num_gpus",
            "site-1",
            ["num_of_gpus", "num_of_cpus", "memory"],
            id="resource_spec-via-default",
        ),
        pytest.param(
            lambda d: d["sites"]["site-1"].update(launcher_spec={"process": {"workdir": "/tmp"}}),
            "sites.site-1.launcher_spec.process.workdir",
            "site-1",
            ["env", "cwd"],
            id="process-launcher-block",
        ),
    ],
)
def test_unknown_keys_are_named_with_the_allowed_keys(job_dir, mutate, field, site, allowed) -> None:
    data = base_job()
    mutate(data)
    path, msg = load_error(job_dir, data)
    unknown = field.rsplit(".", 1)[-1]
    line = next(line for line in msg.splitlines() if f"unknown key {unknown!r}" in line)
    assert line.strip().startswith(f"{path}: {field}")
    if site:
        assert f"(site {site!r})" in line
    listed = line.split("allowed keys:", 1)[1].split(", ")
    listed = [key.strip() for key in listed]
    for key in allowed:
        assert key in listed, f"{key!r} missing from the allowed keys in {line!r}"
    assert unknown not in listed


@pytest.mark.parametrize("rounds", [0, -1])
def test_rounds_must_be_at_least_one(job_dir, rounds) -> None:
    data = base_job()
    data["rounds"] = rounds
    path, msg = load_error(job_dir, data)
    assert f"{path}: rounds:" in msg
    assert "greater than or equal to 1" in msg


def test_min_clients_cannot_exceed_the_sites(job_dir) -> None:
    data = base_job()
    data["min_clients"] = 3
    path, msg = load_error(job_dir, data)
    assert str(path) in msg
    assert "min_clients is 3 but the job has only 2 site(s) (site-1, site-2)" in msg
    assert "lower min_clients or add sites" in msg


@pytest.mark.parametrize("name", ["Site_1", "SITE-1", "site_1", "-site", "site-", "site.1", "a" * 64])
def test_site_names_must_be_pod_names(job_dir, name) -> None:
    data = base_job()
    data["sites"] = {name: {}, "site-2": {}}
    path, msg = load_error(job_dir, data)
    assert f"{path}: sites:" in msg
    assert f"site name {name!r} cannot be a pod name" in msg
    assert "lowercase letters, digits and '-'" in msg
    assert "at most 63 characters" in msg


def test_a_63_character_site_name_is_allowed(job_dir) -> None:
    data = base_job()
    data["sites"] = {"a" * 63: {}, "site-2": {}}
    assert "a" * 63 in load_job(write_job(job_dir, data)).sites


def test_missing_trainer_script(job_dir) -> None:
    data = base_job()
    data["trainer"]["script"] = "nope/train.py"
    path, msg = load_error(job_dir, data)
    assert str(path) in msg
    assert "trainer.script 'nope/train.py' does not exist" in msg
    assert str(job_dir.resolve() / "nope" / "train.py") in msg


def test_missing_initial_model(job_dir) -> None:
    data = base_job()
    data["initial_model"] = "models/start.safetensors"
    path, msg = load_error(job_dir, data)
    assert str(path) in msg
    assert "initial_model 'models/start.safetensors' does not exist" in msg
    assert str(job_dir.resolve() / "models" / "start.safetensors") in msg


@pytest.mark.parametrize("key", ["args", "command"])
def test_trainer_argv_given_as_a_string(job_dir, key) -> None:
    data = base_job()
    data["trainer"][key] = "--seed 0 --lr 0.1"
    path, msg = load_error(job_dir, data)
    assert f"{path}: trainer.{key}:" in msg
    assert "must be a list of arguments, not a string" in msg
    assert "never run through a shell" in msg


def test_trainer_args_numbers_become_strings_but_booleans_are_refused(job_dir) -> None:
    data = base_job()
    data["trainer"]["args"] = ["--lr", 0.5, "--epochs", 3, "--name", "x"]
    job = load_job(write_job(job_dir, data))
    assert job.trainer.args == ["--lr", "0.5", "--epochs", "3", "--name", "x"]
    data["trainer"]["args"] = ["--flag", True]
    _, msg = load_error(job_dir, data)
    assert "trainer.args" in msg
    assert "argument True must be a string or a number" in msg


@pytest.mark.parametrize("launcher", ["docker", "podman"])
def test_nvflares_docker_is_a_container_site(job_dir, launcher) -> None:
    data = base_job()
    data["sites"]["site-2"] = {"launcher": launcher}
    path, msg = load_error(job_dir, data)
    line = next(line for line in msg.splitlines() if "site-2" in line)
    assert line.strip().startswith(f"{path}: sites.site-2 (site 'site-2'):")
    assert "a container site needs its trainer image: set launcher_spec.container.image" in line
    assert "site-1" not in msg


def test_unknown_launcher_name(job_dir) -> None:
    data = base_job()
    data["sites"]["site-1"] = {"launcher": "ssh"}
    path, msg = load_error(job_dir, data)
    assert f"{path}: sites.site-1.launcher (site 'site-1')" in msg
    assert "'process'" in msg


def test_default_site_is_merged_and_the_site_wins(job_dir) -> None:
    data = base_job()
    data["sites"] = {
        "@default": {
            "retries": 2,
            "weight": 0.5,
            "resource_spec": {"num_of_gpus": 1, "memory": "4Gi"},
            "resource_manager": {"type": "gpu", "num_of_gpus": 2},
        },
        "site-1": {},
        "site-2": {"retries": 5, "resource_spec": {"num_of_gpus": 2}},
    }
    job = load_job(write_job(job_dir, data))
    assert list(job.sites) == ["site-1", "site-2"]
    one, two = job.sites["site-1"], job.sites["site-2"]
    assert (one.retries, one.weight, one.resource_spec.num_of_gpus, one.resource_spec.memory) == (2, 0.5, 1, "4Gi")
    # resource_spec merges key by key: the site's num_of_gpus wins, memory is inherited.
    assert (two.retries, two.weight, two.resource_spec.num_of_gpus, two.resource_spec.memory) == (5, 0.5, 2, "4Gi")
    assert job.site_weights() == {"site-1": 0.5, "site-2": 0.5}


def test_nvflare_top_level_resource_spec(job_dir) -> None:
    data = base_job()
    data["resource_spec"] = {"@default": {"num_of_gpus": 1, "memory": "2Gi"}, "site-1": {"num_of_gpus": 4}}
    data["sites"] = {"@default": {"resource_manager": {"type": "passthrough"}}, "site-1": {}, "site-2": {}}
    job = load_job(write_job(job_dir, data))
    assert job.sites["site-1"].resource_spec.num_of_gpus == 4
    assert job.sites["site-1"].resource_spec.memory == "2Gi"
    assert job.sites["site-2"].resource_spec.num_of_gpus == 1
    # A site's own resource_spec beats the top-level block for that site.
    data["sites"]["site-1"] = {"resource_spec": {"num_of_gpus": 8}, "resource_manager": {"type": "passthrough"}}
    assert load_job(write_job(job_dir, data)).sites["site-1"].resource_spec.num_of_gpus == 8


def test_launcher_spec_merges_shallowly_per_backend_most_specific_last(job_dir) -> None:
    data = base_job()
    data["sites"]["site-3"] = {}
    data["launcher_spec"] = {
        "default": {"process": {"env": {"FROM": "top-default", "A": "1"}, "cwd": "/top-default"}},
        "site-1": {"process": {"env": {"FROM": "top-site-1"}}},
        "site-3": {"process": {"cwd": "/top-site-3"}},
    }
    data["sites"]["@default"] = {"launcher_spec": {"process": {"cwd": "/sites-default"}}}
    data["sites"]["site-3"] = {"launcher_spec": {"process": {"cwd": "/own-site-3"}}}
    job = load_job(write_job(job_dir, data))
    one = job.sites["site-1"].launcher_spec.process
    two = job.sites["site-2"].launcher_spec.process
    three = job.sites["site-3"].launcher_spec.process
    # Shallow: site-1's env replaces the default env as a whole (no key-level merge inside env).
    assert one.env == {"FROM": "top-site-1"}
    assert one.cwd == "/sites-default"
    assert two.env == {"FROM": "top-default", "A": "1"}
    assert two.cwd == "/sites-default"
    assert three.env == {"FROM": "top-default", "A": "1"}
    assert three.cwd == "/own-site-3"


def test_launcher_spec_kubernetes_is_an_alias_of_k8s(job_dir) -> None:
    data = base_job()
    data["launcher_spec"] = {"default": {"kubernetes": {"namespace": "fl", "image": "a"}}}
    data["sites"]["site-2"] = {"launcher_spec": {"k8s": {"image": "b"}}}
    job = load_job(write_job(job_dir, data))
    one, two = job.sites["site-1"].launcher_spec.k8s, job.sites["site-2"].launcher_spec.k8s
    assert (one.namespace, one.image) == ("fl", "a")
    assert (two.namespace, two.image) == ("fl", "b")


def test_launcher_spec_unknown_backend(job_dir) -> None:
    data = base_job()
    data["sites"]["site-1"] = {"launcher_spec": {"pbs": {}}}
    path, msg = load_error(job_dir, data)
    assert str(path) in msg
    assert "sites.site-1.launcher_spec: unknown launcher backend 'pbs'" in msg
    assert "allowed: process, k8s, slurm, container (aliases: kubernetes, docker, podman)" in msg


@pytest.mark.parametrize("block", ["launcher_spec", "resource_spec"])
def test_top_level_block_naming_an_unknown_site(job_dir, block) -> None:
    data = base_job()
    data[block] = {"site-9": {"process": {}} if block == "launcher_spec" else {"num_of_gpus": 1}}
    path, msg = load_error(job_dir, data)
    assert str(path) in msg
    assert f"{block} names site 'site-9', which is not in sites (site-1, site-2)" in msg


def test_sites_given_as_a_list(job_dir) -> None:
    data = base_job()
    data["sites"] = ["site-1", "site-2", "site-3"]
    job = load_job(write_job(job_dir, data))
    assert list(job.sites) == ["site-1", "site-2", "site-3"]
    assert all(site.launcher == "process" and site.weight == 1.0 for site in job.sites.values())


def test_no_sites(job_dir) -> None:
    data = base_job()
    data["sites"] = {}
    data["min_clients"] = 1
    path, msg = load_error(job_dir, data)
    assert f"{path}: sites:" in msg
    assert "at least one site" in msg


def test_memory_quantity_is_checked(job_dir) -> None:
    data = base_job()
    data["sites"]["site-2"] = {"resource_spec": {"memory": "4 gigs"}}
    path, msg = load_error(job_dir, data)
    assert f"{path}: sites.site-2.resource_spec.memory (site 'site-2')" in msg
    assert "'4Gi'" in msg


def test_job_from_python_equals_job_from_yaml(job_dir) -> None:
    data = base_job()
    data["resource_spec"] = {"@default": {"num_of_gpus": 1}}
    data["launcher_spec"] = {"default": {"process": {"env": {"A": "1"}}}}
    data["sites"]["@default"] = {"retries": 3, "resource_manager": {"num_of_gpus": 2}}
    data["trainer"]["args"] = ["--lr", 0.5]
    data["trainer"]["hparams"] = {"lr": 0.1, "epochs": 2}
    from_yaml = load_job(write_job(job_dir, copy.deepcopy(data)))
    from_python = job_from_dict(data, base_dir=str(job_dir.resolve()))
    assert isinstance(from_python, JobConfig)
    assert from_python == from_yaml
    assert from_python.model_dump() == from_yaml.model_dump()
    # The caller's mapping is not modified by validation.
    assert data["sites"]["@default"] == {"retries": 3, "resource_manager": {"num_of_gpus": 2}}
    assert "resource_spec" in data


def test_job_from_dict_errors_name_the_source(job_dir) -> None:
    data = base_job()
    data["rounds"] = 0
    with pytest.raises(ConfigError) as info:
        job_from_dict(data, base_dir=str(job_dir))
    assert "<python>: rounds:" in str(info.value)
    with pytest.raises(ConfigError) as info:
        job_from_dict(data, source="my_dag.py", base_dir=str(job_dir))
    assert "my_dag.py: rounds:" in str(info.value)


def test_every_error_is_reported_at_once(job_dir) -> None:
    data = base_job()
    data["rounds"] = 0
    data["trainer"]["args"] = "--x"
    data["sites"]["site-1"] = {"retries": -1}
    _, msg = load_error(job_dir, data)
    fields = re.findall(r"job\.yaml: ([\w.-]+)", msg)
    assert {"rounds", "trainer.args", "sites.site-1.retries"} <= set(fields)


@pytest.mark.parametrize("name", ["Demo", "demo job", "-demo", "x" * 51])
def test_job_name_is_checked(job_dir, name) -> None:
    data = base_job()
    data["job"] = name
    path, msg = load_error(job_dir, data)
    assert f"{path}: job:" in msg
    assert f"job name {name!r} is not allowed" in msg


def test_gpu_requests_need_a_resource_manager_and_must_fit_the_site(job_dir) -> None:
    data = base_job()
    data["sites"] = {"site-1": {"resource_spec": {"num_of_gpus": 1}}, "site-2": {}}
    path, msg = load_error(job_dir, data)
    assert f"{path}: sites.site-1 (site 'site-1'): a site job asks for 1 GPU(s)" in msg
    assert "declares no resource_manager" in msg
    data["sites"]["site-1"]["resource_manager"] = {"type": "gpu", "num_of_gpus": 2}
    data["sites"]["site-1"]["resource_spec"]["num_of_gpus"] = 3
    path, msg = load_error(job_dir, data)
    assert "asks for 3 GPUs but the site has only 2" in msg and "wait for pool slots forever" in msg
    data["sites"]["site-1"]["resource_spec"]["num_of_gpus"] = 2
    job = load_job(write_job(job_dir, data))
    assert job.sites["site-1"].pool_name("site-1") == "flare_gpu_site-1"
    assert job.sites["site-2"].pool_name("site-2") is None  # no GPUs asked: default pool
    data["sites"]["site-1"]["resource_manager"]["gpu_class"] = "a100"
    assert load_job(write_job(job_dir, data)).sites["site-1"].pool_name("site-1") == "flare_gpu_site-1_a100"
    data["sites"]["site-1"]["resource_manager"] = {"type": "passthrough"}
    assert load_job(write_job(job_dir, data)).sites["site-1"].pool_name("site-1") is None


def test_every_field_error_names_its_line(tmp_path: pathlib.Path) -> None:
    """Field errors, errors from @default, NVFlare's blocks and cross-field checks: all carry a line."""
    model = REPO / "examples" / "digits" / "initial_model.safetensors"
    script = REPO / "examples" / "digits" / "trainer.py"
    path = tmp_path / "job.yaml"
    path.write_text(
        "job: demo\n"  # 1
        "rounds: 0\n"  # 2
        "min_clients: 9\n"  # 3
        f"initial_model: {model}\n"  # 4
        "trainer:\n"  # 5
        f"  script: {script}\n"  # 6
        "  colour: red\n"  # 7
        "sites:\n"  # 8
        '  "@default": {retries: -1}\n'  # 9
        "  site-1: {}\n"  # 10
        "resource_spec:\n"  # 11
        "  site-1: {num_of_gpus: x}\n"  # 12
    )
    with pytest.raises(ConfigError) as info:
        load_job(path)
    msg = str(info.value)
    assert f"{path}:2: rounds: must be greater than or equal to 1" in msg
    assert f"{path}:7: trainer.colour: unknown key 'colour'" in msg
    assert f"{path}:9: sites.site-1.retries (site 'site-1')" in msg  # set in @default, reported there
    assert f"{path}:12: sites.site-1.resource_spec.num_of_gpus (site 'site-1')" in msg  # NVFlare's block
    path.write_text(
        path.read_text()
        .replace("rounds: 0", "rounds: 1")
        .replace("  colour: red\n", "")
        .replace("{retries: -1}", "{}")
        .replace("{num_of_gpus: x}", "{num_of_gpus: 0}")
    )
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert f"{path}:3: min_clients is 9 but the job has only 1 site(s)" in str(info.value)  # a cross-field check


def test_unknown_keys_do_not_offer_internal_keys(job_dir) -> None:
    data = base_job()
    data["colour"] = "red"
    _, msg = load_error(job_dir, data)
    assert "allowed keys: job, rounds" in msg
    assert "base_dir" not in msg
