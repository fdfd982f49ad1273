"""Site tasks: the arguments a site's spec gives them, and the site job they describe."""

from __future__ import annotations

import json
from datetime import timedelta

from flare_airflow.launchers.trainer import trainer_argv
from flare_airflow.operators.common import store_for
from flare_airflow.operators.site import SiteTrainOperator
from flare_airflow.operators.site_steps import SERVER_SITE, make_evaluation_run, make_site_run, site_task_defaults
from tests.unit.airflow_layer import RUN_ID, FakeTI, context, make_job

GPU_SITE = {
    "retries": 3,
    "retry_delay_seconds": 42,
    "resource_spec": {"num_of_gpus": 2},
    "resource_manager": {"type": "gpu", "num_of_gpus": 4, "gpu_class": "a100"},
}


def test_site_task_defaults_come_from_the_site_spec(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": GPU_SITE, "site-2": {}}, trainer={"script": "train.py", "timeout": 600})
    gpu: dict = {}
    site_task_defaults(job, "site-1", gpu)
    assert gpu == {
        "pool": "flare_gpu_site-1_a100",
        "pool_slots": 2,
        "retries": 3,
        "retry_delay": timedelta(seconds=42),
        "execution_timeout": timedelta(seconds=600),
    }
    plain: dict = {"retries": 9}
    site_task_defaults(job, "site-2", plain)
    assert "pool" not in plain and "pool_slots" not in plain
    assert plain["retries"] == 9  # what the DAG author passed wins


def test_make_site_run_stages_each_try_apart(tmp_path) -> None:
    job = make_job(tmp_path)
    store = store_for(job)  # the Airflow layer's store: ObjectStoragePath URIs
    ti = FakeTI(try_number=3, xcoms={("prepare", "return_value"): {"sha256": "ab" * 32}})
    run = make_site_run(job, "site-1", 1, context(ti), argv=trainer_argv(job), global_task_id="prepare")
    assert (run.job, run.run_id, run.round, run.site, run.task) == ("unit", RUN_ID, 1, "site-1", "train")
    assert run.global_model == str(store.global_model("unit", RUN_ID, 0))
    assert run.output == str(store.site_update("unit", RUN_ID, 1, "site-1"))
    assert run.staging == str(store.staging("unit", RUN_ID, 1, "site-1", 3))
    assert run.staging.endswith("/staging/site-1/try-3/update.safetensors")
    assert run.global_sha256 == "ab" * 32
    assert run.total_rounds == 2


def test_the_evaluation_run_is_built_like_a_site_run_without_staging_or_devices(tmp_path) -> None:
    job = make_job(tmp_path)
    store = store_for(job)
    ti = FakeTI(try_number=2)
    train = make_site_run(job, "site-1", 1, context(ti), argv=trainer_argv(job))
    run = make_evaluation_run(job, 1, context(ti), global_model=str(store.global_model("unit", RUN_ID, 1)))
    assert (run.job, run.run_id, run.round, run.site, run.task) == ("unit", RUN_ID, 1, SERVER_SITE, "evaluate")
    assert (run.argv, run.total_rounds, run.hparams) == (train.argv, train.total_rounds, train.hparams)
    assert (run.launch_timeout, run.shutdown_timeout) == (train.launch_timeout, train.shutdown_timeout)
    assert run.output == str(store.evaluation("unit", RUN_ID, 1))
    assert run.staging is None and run.env == {} and run.cwd is None and not run.assign_gpus
    assert run.site_job().env["FLARE_OUTPUT"] == run.output


def test_the_site_job_spec_carries_references_never_secret_values(tmp_path) -> None:
    job = make_job(
        tmp_path,
        sites={
            "site-1": {
                "launcher_spec": {
                    "process": {"env": {"MODE": "fast"}, "secret_env": {"API_TOKEN": {"variable": "token"}}}
                }
            },
            "site-2": {},
        },
    )
    task = SiteTrainOperator(task_id="site-1", job=job, site="site-1", round_num=1, global_task_id="prepare")
    spec = json.loads(task.site_run(context(FakeTI())).to_json())
    assert spec["env"] == {"MODE": "fast"}
    assert "API_TOKEN" not in json.dumps(spec)
    assert spec["argv"] == trainer_argv(job)
    assert task.bash_command.endswith("-m flare_airflow.site_task")


def test_the_worker_applies_its_site_policy_at_run_time(tmp_path, monkeypatch) -> None:
    from flare_airflow.operators.site_steps import job_at_site

    job = make_job(tmp_path, sites={"site-1": {"launcher_spec": {"process": {"env": {"FROM_JOB": "1"}}}}, "site-2": {}})
    assert job_at_site(job, "site-1", context(), 1) is job  # no policy on this worker: the job as written
    policy = tmp_path / "site.yaml"
    policy.write_text("sites:\n  site-1: {launcher_spec: {process: {env: {FROM_SITE: '1'}}}}\n")
    monkeypatch.setenv("FLARE_SITE_CONFIG", str(policy))
    at_site = job_at_site(job, "site-1", context(), 1)
    assert at_site.sites["site-1"].launcher_spec.process.env == {"FROM_SITE": "1"}
    run = make_site_run(at_site, "site-1", 1, context(), argv=["python", "t.py"])
    assert run.env == {"FROM_SITE": "1"}


def test_a_policy_the_job_does_not_fit_fails_the_site_with_its_failure_record(tmp_path, monkeypatch) -> None:
    import pytest

    from flare_airflow.core.failure_record import read_failure
    from flare_airflow.operators.site_steps import SiteJobFailed, job_at_site

    job = make_job(tmp_path)
    policy = tmp_path / "site.yaml"
    policy.write_text("sites:\n  site-1: {}\n")
    monkeypatch.setenv("FLARE_SITE_CONFIG", str(policy))
    ti = FakeTI()
    with pytest.raises(SiteJobFailed, match="covers only site-1"):
        job_at_site(job, "site-2", context(ti), 1)
    output = store_for(job).site_update(job.job, RUN_ID, 1, "site-2")
    assert "which queues this worker serves (--queues) [CONFIG_ERROR]" in (read_failure(output) or "")


def test_the_site_policy_may_come_from_an_airflow_variable_and_a_policy_file_wins(tmp_path, monkeypatch) -> None:
    import pytest

    from flare_airflow.operators.site_steps import SiteJobFailed, job_at_site

    job = make_job(tmp_path, sites={"site-1": {}, "site-2": {}})
    monkeypatch.setenv(
        "AIRFLOW_VAR_FLARE_SITE_POLICY", '{"sites": {"site-1": {"launcher_spec": {"process": {"env": {"V": "1"}}}}}}'
    )
    assert job_at_site(job, "site-1", context(), 1).sites["site-1"].launcher_spec.process.env == {"V": "1"}
    policy = tmp_path / "site.yaml"
    policy.write_text("sites:\n  site-1: {launcher_spec: {process: {env: {F: '1'}}}}\n")
    monkeypatch.setenv("FLARE_SITE_CONFIG", str(policy))
    assert job_at_site(job, "site-1", context(), 1).sites["site-1"].launcher_spec.process.env == {"F": "1"}
    monkeypatch.delenv("FLARE_SITE_CONFIG")
    monkeypatch.setenv("AIRFLOW_VAR_FLARE_SITE_POLICY", "sites: {site-1: {launcher_spec: {process: {cwd: [}}}}")
    with pytest.raises(SiteJobFailed, match=r"site policy: Airflow variable flare_site_policy:1:\d+: malformed YAML"):
        job_at_site(job, "site-1", context(), 1)
