"""Compose your own pipeline from the site-job operator and sensor, without the federated builder.

One round of the digits job on two SLURM sites: each site's job is launched by one task and
watched by a sensor in ``reschedule`` mode (no worker slot is held between checks); FedAvg and
publishing are the builder's own operators. The builder makes the same shape with
``watch: sensor`` (docs/sensors.md).
"""

from pathlib import Path

from airflow.sdk import DAG

from flare_airflow.builder import job_params
from flare_airflow.core.config import job_from_dict
from flare_airflow.operators.aggregate import AggregateOperator
from flare_airflow.operators.run import PrepareRunOperator, PublishOperator
from flare_airflow.operators.site_job import SiteJobLaunchOperator
from flare_airflow.operators.slurm import SweepSlurmJobsOperator
from flare_airflow.sensors.site_job import SiteJobSensor

HERE = Path(__file__).parent
SITES = ("hpc-a", "hpc-b")

job = job_from_dict(
    {
        "job": "digits-watch",
        "rounds": 1,
        "min_clients": 2,
        "initial_model": "../examples/digits/initial_model.safetensors",
        "trainer": {"script": "../examples/digits/trainer.py", "args": ["--num-sites", "2", "--seed", "0"]},
        "sites": {
            "@default": {"launcher": "slurm", "retries": 1, "launcher_spec": {"slurm": {"time_limit": "00:30:00"}}},
            **{site: {} for site in SITES},
        },
    },
    base_dir=str(HERE),
)

with DAG("flare_digits_launch_and_watch", schedule=None, catchup=False, params=job_params(job), tags=["example"]):
    prepare = PrepareRunOperator(task_id="prepare", job=job)
    watches = []
    for site in SITES:
        launch = SiteJobLaunchOperator(
            task_id=f"{site}_launch", job=job, site=site, round_num=1, global_task_id="prepare"
        )
        watch = SiteJobSensor(
            task_id=site,
            job=job,
            site=site,
            round_num=1,
            launch_task_id=launch.task_id,
            mode="reschedule",  # or deferrable=True: the wait moves to the triggerer
            poke_interval=15,
            timeout=3600,
        )
        prepare >> launch >> watch
        watches.append(watch)
    aggregate = AggregateOperator(
        task_id="global_model",
        job=job,
        round_num=1,
        site_task_ids={site: site for site in SITES},
        global_task_id="prepare",
    )
    publish = PublishOperator(task_id="publish", job=job, aggregate_task_ids=[aggregate.task_id])
    watches >> aggregate >> publish
    publish >> SweepSlurmJobsOperator(task_id="sweep_slurm_jobs", job=job).as_teardown()
