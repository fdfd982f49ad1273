"""``flare-airflow import-nvflare``: job folders in NVFlare 2.5-2.8's shape (HOCON) and refusals.

The 2.9 shape, exported by NVFlare itself and run against its simulator: tests/e2e/test_nvflare_jobs.py.
The 2.5-2.8 shape cannot be exported by NVFlare 2.9 (its launcher executors are gone), so it is
written here as that release's ``nvflare job create`` templates lay it out (sag_np, sag_pt).
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file

from flare_airflow.cli import main
from flare_airflow.core.config import load_job
from flare_airflow.launchers.trainer import trainer_argv
from flare_airflow.nvflare.importer import NvflareJobError, import_job

CLIENT = "import nvflare.client as flare\nflare.init()\n"

META_CONF = """\
{
  name = "sag-np"
  resource_spec = { site-1 = { num_of_gpus = 0, mem_per_gpu_in_GiB = 0 } }
  deploy_map { app = ["@ALL"] }
  min_clients = 2
}
"""

SERVER_CONF = """\
{
  format_version = 2
  task_data_filters = []
  task_result_filters = []
  workflows = [
    {
      id = "scatter_and_gather"
      path = "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather"
      args {
        min_clients = 2
        num_rounds = 4
        start_round = 0
        wait_time_after_min_received = 0
        aggregator_id = "aggregator"
        persistor_id = "persistor"
        shareable_generator_id = "shareable_generator"
        train_task_name = "train"
        train_timeout = 0
      }
    }
  ]
  components = [
    { id = "persistor", path = "nvflare.app_common.np.np_model_persistor.NPModelPersistor" }
    {
      id = "shareable_generator"
      path = "nvflare.app_common.shareablegenerators.full_model_shareable_generator.FullModelShareableGenerator"
      args = {}
    }
    {
      id = "aggregator"
      path = "nvflare.app_common.aggregators.intime_accumulate_model_aggregator.InTimeAccumulateWeightedAggregator"
      args { expected_data_kind = "WEIGHT_DIFF", aggregation_weights { site-1 = 2.0, site-2 = 1.0 } }
    }
    {
      id = "model_selector"
      path = "nvflare.app_common.widgets.intime_model_selector.IntimeModelSelector"
      args.key_metric = "accuracy"
    }
  ]
}
"""

CLIENT_CONF = """\
{
  format_version = 2
  executors = [
    {
      tasks = ["train"]
      executor {
        path = "nvflare.app_common.executors.client_api_launcher_executor.ClientAPILauncherExecutor"
        args {
          launcher_id = "launcher"
          pipe_id = "pipe"
          heartbeat_timeout = 60
          params_exchange_format = "numpy"
          params_transfer_type = "DIFF"
          train_with_evaluation = true
        }
      }
    }
  ]
  task_data_filters = []
  task_result_filters = []
  components = [
    {
      id = "launcher"
      path = "nvflare.app_common.launchers.subprocess_launcher.SubprocessLauncher"
      args { script = "python3 -u custom/train.py --epochs 2", launch_once = true }
    }
    {
      id = "pipe"
      path = "nvflare.fuel.utils.pipe.cell_pipe.CellPipe"
      args { mode = "PASSIVE", site_name = "{SITE_NAME}", token = "{JOB_ID}", root_url = "", secure_mode = true }
    }
  ]
}
"""


def write_job(root: pathlib.Path, *, server: str = SERVER_CONF, client: str = CLIENT_CONF) -> pathlib.Path:
    job = root / "sag-np"
    (job / "app" / "config").mkdir(parents=True)
    (job / "app" / "custom").mkdir()
    (job / "meta.conf").write_text(META_CONF)
    (job / "app" / "config" / "config_fed_server.conf").write_text(server)
    (job / "app" / "config" / "config_fed_client.conf").write_text(client)
    (job / "app" / "custom" / "train.py").write_text(CLIENT)
    return job


def test_launcher_executor_shape_in_hocon(tmp_path) -> None:
    job_dir = write_job(tmp_path)
    result = import_job(job_dir, tmp_path / "out", sites=["site-1", "site-2"])
    job = yaml.safe_load(result.job_file.read_text())
    assert job["job"] == "sag-np" and job["rounds"] == 4 and job["min_clients"] == 2
    assert job["trainer"] == {
        "script": "sag-np/custom/train.py",
        "args": ["--epochs", "2"],
        "nvflare": {"params_exchange": "numpy", "transfer": "DIFF"},
    }
    assert job["sites"]["site-1"] == {"resource_spec": {"num_of_gpus": 0, "mem_per_gpu_in_GiB": 0}, "weight": 2.0}
    assert job["sites"]["site-2"] == {"weight": 1.0}
    # NPModelPersistor without a model starts from NVFlare's default array, as NVFlare does.
    initial = load_file(str(result.job_dir / "initial_model.safetensors"))["numpy_key"]
    np.testing.assert_array_equal(initial, np.arange(1, 10, dtype=np.float32).reshape(3, 3))
    notes = "\n".join(result.notes)
    assert "config_fed_client.conf:" in notes and "launch_once" in notes and "CellPipe" in notes
    assert "IntimeModelSelector" in notes
    # The job is a valid flare-airflow job whose trainer runs through the NVFlare runner.
    loaded = load_job(result.job_file)
    argv = trainer_argv(loaded)
    assert argv[:3] == [sys.executable, "-m", "flare_airflow.core.nvflare.run"]
    assert argv[3:7] == ["--params-exchange", "numpy", "--transfer", "DIFF"]
    assert argv[7:] == [str(result.job_dir / "custom" / "train.py"), "--epochs", "2"]
    assert "flare_airflow.builder" in result.dag_file.read_text()


def test_all_deploy_map_needs_sites_and_nothing_is_written(tmp_path, capsys) -> None:
    job_dir = write_job(tmp_path)
    out = tmp_path / "out"
    assert main(["import-nvflare", str(job_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{job_dir / 'meta.conf'}:4:" in err and "--sites site-1,site-2" in err
    assert not out.exists()


def test_refusals_name_component_file_line_and_what_to_do(tmp_path) -> None:
    server = SERVER_CONF.replace("ScatterAndGather", "ScatterAndGatherScaffold").replace(
        "num_rounds = 4", 'num_rounds = 4\n        stop_cond = "accuracy >= 80"'
    )
    client = CLIENT_CONF.replace(
        "task_result_filters = []",
        'task_result_filters = [{ tasks = ["train"], filters = [{ path = "my_site.filters.Clip", args {} }] }]',
    ).replace('"nvflare.app_common.launchers.subprocess_launcher.SubprocessLauncher"', '"my_site.launchers.Custom"')
    job_dir = write_job(tmp_path, server=server, client=client)
    with pytest.raises(NvflareJobError) as refused:
        import_job(job_dir, tmp_path / "out", sites=["site-1", "site-2"])
    text = str(refused.value)
    refusals = text.splitlines()[1:]
    assert len(refusals) == 3, text
    for refusal, (config, needle) in zip(
        refusals,
        [
            ("server", "ScatterAndGatherScaffold"),
            ("client", "my_site.launchers.Custom"),
            ("client", "my_site.filters.Clip"),
        ],
        strict=True,
    ):
        file, line = refusal.strip().split(": ", 1)[0].rsplit(":", 1)
        assert file == str(job_dir / "app" / "config" / f"config_fed_{config}.conf")
        assert needle in pathlib.Path(file).read_text().splitlines()[int(line) - 1], refusal
    assert "SCAFFOLD" in text and "filter" in text and "site's policy" in text
    assert not (tmp_path / "out").exists()


def test_pytorch_persistor_needs_an_initial_model(tmp_path) -> None:
    server = SERVER_CONF.replace(
        '{ id = "persistor", path = "nvflare.app_common.np.np_model_persistor.NPModelPersistor" }',
        '{ id = "persistor", path = "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor", '
        'args { model { path = "net.Net" } } }',
    )
    client = CLIENT_CONF.replace('params_exchange_format = "numpy"', 'params_exchange_format = "pytorch"')
    job_dir = write_job(tmp_path, server=server, client=client)
    with pytest.raises(NvflareJobError, match=r"PTFileModelPersistor.*--initial-model"):
        import_job(job_dir, tmp_path / "out", sites=["site-1", "site-2"])
    start = tmp_path / "init.safetensors"
    save_file({"fc.weight": np.zeros((2, 2), np.float32)}, str(start))
    result = import_job(job_dir, tmp_path / "out", sites=["site-1", "site-2"], initial_model=start)
    assert result.job["trainer"]["nvflare"] == {"params_exchange": "pytorch", "transfer": "DIFF"}
    assert (result.job_dir / "initial_model.safetensors").read_bytes() == start.read_bytes()
    with pytest.raises(NvflareJobError, match="--force"):
        import_job(job_dir, tmp_path / "out", sites=["site-1", "site-2"], initial_model=start)


def test_sites_with_different_client_scripts_are_refused(tmp_path) -> None:
    job = tmp_path / "two"
    for site, body in (("site-1", CLIENT), ("site-2", CLIENT + "print('different')\n")):
        (job / f"app_{site}" / "config").mkdir(parents=True)
        (job / f"app_{site}" / "custom").mkdir()
        (job / f"app_{site}" / "config" / "config_fed_client.conf").write_text(CLIENT_CONF)
        (job / f"app_{site}" / "custom" / "train.py").write_text(body)
    (job / "app_server" / "config").mkdir(parents=True)
    (job / "app_server" / "config" / "config_fed_server.conf").write_text(SERVER_CONF)
    meta = {"name": "two", "deploy_map": {"app_server": ["server"], "app_site-1": ["site-1"], "app_site-2": ["site-2"]}}
    (job / "meta.json").write_text(json.dumps(meta, indent=2))
    with pytest.raises(NvflareJobError, match=r"client app 'app_site-2'.*differ from app 'app_site-1'"):
        import_job(job, tmp_path / "out")


FILTERS = """task_result_filters = [
    {
      tasks = ["train"]
      filters = [
        {
          path = "nvflare.app_common.filters.exclude_vars.ExcludeVars"
          args { exclude_vars = ["head.weight", "head.bias"] }
        }
        { path = "nvflare.app_common.filters.exclude_vars.ExcludeVars", args { exclude_vars = "bn[0-9]" } }
        {
          path = "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy"
          args { percentile = 20, gamma = 0.05 }
        }
      ]
    }
  ]"""


def test_client_result_filters_become_the_sites_privacy_policy(tmp_path, capsys) -> None:
    """ExcludeVars and PercentilePrivacy carry over -- as site policy, which the job cannot carry."""
    import re

    from flare_airflow.core.config.policy import SitePolicy

    job_dir = write_job(tmp_path, client=CLIENT_CONF.replace("task_result_filters = []", FILTERS))
    out = tmp_path / "out"
    assert main(["import-nvflare", str(job_dir), "--out", str(out), "--sites", "site-1,site-2"]) == 0
    printed = capsys.readouterr().out
    policy_file = out / "sag-np.site-policy.yaml"
    assert f"wrote {policy_file}" in printed and "site policy in flare-airflow" in printed
    policy = SitePolicy.model_validate(yaml.safe_load(policy_file.read_text()))
    assert sorted(policy.sites) == ["site-1", "site-2"]
    filters = [f.model_dump(exclude_none=True) for f in policy.entry("site-1").privacy.filters]
    assert filters == [
        {"type": "exclude_vars", "names": ["head.weight", "head.bias"]},
        {"type": "exclude_vars", "names": [], "regex": ".*(?:bn[0-9]).*"},
        {"type": "percentile", "percentile": 20.0, "gamma": 0.05},
    ]
    # NVFlare's ExcludeVars searches its regex anywhere in a name: so does the mapped full match.
    regex = filters[1]["regex"]
    for name in ("layer.bn1.weight", "bn2", "fc.weight"):
        assert bool(re.fullmatch(regex, name)) == bool(re.search("bn[0-9]", name))
    job = yaml.safe_load((out / "sag-np.yaml").read_text())
    assert "privacy" not in job and all("privacy" not in s for s in job["sites"].values())


@pytest.mark.parametrize(
    ("filters", "needle", "why"),
    [
        (
            'task_result_filters = [{ tasks = ["train"], filters = [{ path = '
            '"nvflare.app_common.filters.svt_privacy.SVTPrivacy", args { epsilon = 0.1 } }] }]',
            "SVTPrivacy",
            "sparse vector technique",
        ),
        (
            'task_data_filters = [{ tasks = ["train"], filters = [{ path = '
            '"nvflare.app_common.filters.exclude_vars.ExcludeVars", args { exclude_vars = ["a"] } }] }]',
            "ExcludeVars",
            "what the site receives",
        ),
        (
            'task_result_filters = [{ tasks = ["train"], filters = [{ path = '
            '"nvflare.app_common.filters.percentile_privacy.PercentilePrivacy", args { percentile = 150 } }] }]',
            "PercentilePrivacy",
            "out of range",
        ),
    ],
    ids=["svt", "data-filter", "percentile-range"],
)
def test_filters_without_an_equivalent_are_refused_by_name_file_and_line(tmp_path, filters, needle, why) -> None:
    key = filters.split(" = ", 1)[0]
    job_dir = write_job(tmp_path, client=CLIENT_CONF.replace(f"{key} = []", filters))
    with pytest.raises(NvflareJobError) as refused:
        import_job(job_dir, tmp_path / "out", sites=["site-1", "site-2"])
    refusal = str(refused.value).splitlines()[1].strip()
    file, line = refusal.split(": ", 1)[0].rsplit(":", 1)
    assert file == str(job_dir / "app" / "config" / "config_fed_client.conf")
    assert needle in pathlib.Path(file).read_text().splitlines()[int(line) - 1], refusal
    assert why in refusal and "site's policy" in refusal
    assert not (tmp_path / "out").exists()


def test_server_filters_are_refused(tmp_path) -> None:
    server = SERVER_CONF.replace(
        "task_result_filters = []",
        'task_result_filters = [{ tasks = ["train"], filters = [{ path = '
        '"nvflare.app_common.filters.percentile_privacy.PercentilePrivacy", args {} }] }]',
    )
    job_dir = write_job(tmp_path, server=server)
    with pytest.raises(NvflareJobError, match=r"config_fed_server\.conf:\d+: filter .*PercentilePrivacy.*the server's"):
        import_job(job_dir, tmp_path / "out", sites=["site-1", "site-2"])
