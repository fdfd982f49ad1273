"""Bad SLURM site specs (``launcher_spec.slurm`` and what a SLURM site asks for) and what the user is told.

Each case is a job file with one change to a valid SLURM site, loaded as ``flare-airflow validate``
and every task process load them: the ConfigError names the file, the field and the site. No
cluster is needed: nothing here gets as far as ``sbatch``.
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
TRAINER = REPO / "examples" / "digits" / "trainer.py"
MAX_MESSAGE = 1500

BASE_SLURM: dict[str, Any] = {"partition": "gpu", "account": "fl-lab", "time_limit": "01:00:00"}


@dataclass(frozen=True)
class Bad:
    """One change to the valid SLURM site below."""

    slurm: dict[str, Any] = field(default_factory=dict)  # keys set in launcher_spec.slurm
    site: dict[str, Any] = field(default_factory=dict)  # keys set in the site entry
    script: str = str(TRAINER)


CASES: list[Case] = []
INPUTS: dict[str, Bad] = {}


def case(id: str, bad_input: str, error: str, **bad: Any) -> None:
    CASES.append(Case(id, "slurm", bad_input, error))
    INPUTS[id] = Bad(**bad)


# --- where the job is submitted ----------------------------------------------------------------
case(
    "slurm-connection-unknown",
    "`connection: login.hpc.example.org` (a host name, not a connection)",
    "connection 'login.hpc.example.org' must be 'local' (this worker submits with sbatch) or 'ssh:<conn id>'",
    slurm={"connection": "login.hpc.example.org"},
)
case(
    "slurm-connection-ssh-empty",
    "`connection: 'ssh:'` (no connection id)",
    "must be 'local' (this worker submits with sbatch) or 'ssh:<conn id>' naming an Airflow SSH connection",
    slurm={"connection": "ssh:"},
)
case(
    "slurm-connection-ssh-space",
    "`connection: 'ssh:hpc login'` (a space in the connection id)",
    "connection 'ssh:hpc login' must be 'local'",
    slurm={"connection": "ssh:hpc login"},
)
# --- partition, account, qos, time -------------------------------------------------------------
case(
    "slurm-partition-injection",
    "`partition: 'gpu; rm -rf ~'` (shell text in a name)",
    "partition 'gpu; rm -rf ~' is not a SLURM name",
    slurm={"partition": "gpu; rm -rf ~"},
)
case(
    "slurm-partition-list",
    "`partition: [gpu, cpu]` (a list)",
    "partition (site 'site-1'): must be a string, got list",
    slurm={"partition": ["gpu", "cpu"]},
)
case(
    "slurm-account-comma",
    "`account: 'a,b'` (two accounts)",
    "account 'a,b' is not a SLURM name",
    slurm={"account": "a,b"},
)
case("slurm-qos-empty", "`qos: ''`", "qos '' is not a SLURM name", slurm={"qos": ""})
case(
    "slurm-time-words",
    "`time_limit: 2 hours`",
    "time_limit '2 hours' is not a SLURM time: minutes (30), MM:SS, HH:MM:SS (02:00:00)",
    slurm={"time_limit": "2 hours"},
)
case(
    "slurm-time-zero",
    "`time_limit: 0` (no time at all)",
    "time_limit '0' is not a SLURM time",
    slurm={"time_limit": 0},
)
case(
    "slurm-time-float",
    "`time_limit: 1.5`",
    "time_limit (site 'site-1'): must be a string, got the number 1.5",
    slurm={"time_limit": 1.5},
)
# --- nodes and tasks ---------------------------------------------------------------------------
case(
    "slurm-nodes-zero",
    "`nodes: 0`",
    "nodes (site 'site-1'): must be greater than or equal to 1, got 0",
    slurm={"nodes": 0},
)
case(
    "slurm-nodes-string",
    "`nodes: '2'` (a string)",
    "nodes (site 'site-1'): must be an integer, got str '2'",
    slurm={"nodes": "2"},
)
case(
    "slurm-tasks-per-node-huge",
    "`tasks_per_node: 1000`",
    "tasks_per_node (site 'site-1'): must be less than or equal to 256",
    slurm={"tasks_per_node": 1000},
)
case(
    "slurm-master-port-low",
    "`master_port: 80` (a privileged port)",
    "master_port (site 'site-1'): must be greater than or equal to 1024",
    slurm={"master_port": 80},
)
# --- extra sbatch options ----------------------------------------------------------------------
case(
    "slurm-sbatch-output",
    "`extra_sbatch_options: ['--output=/tmp/x']` (flare-airflow's own option)",
    "sbatch option '--output=/tmp/x' is not allowed: flare-airflow sets the job name, output, environment",
    slurm={"extra_sbatch_options": ["--output=/tmp/x"]},
)
case(
    "slurm-sbatch-wrap",
    "`extra_sbatch_options: ['--wrap=rm -rf /']` (a shell command)",
    "sbatch option '--wrap=rm -rf /' is not allowed",
    slurm={"extra_sbatch_options": ["--wrap=rm -rf /"]},
)
case(
    "slurm-sbatch-export",
    "`extra_sbatch_options: ['--export=ALL']` (the environment is flare-airflow's)",
    "flare-airflow sets the job name, output, environment and working directory",
    slurm={"extra_sbatch_options": ["--export=ALL"]},
)
case(
    "slurm-sbatch-partition",
    "`extra_sbatch_options: ['--partition=debug']` (has its own field)",
    "sbatch option '--partition=debug' is not allowed: use launcher_spec.slurm.partition instead",
    slurm={"extra_sbatch_options": ["--partition=debug"]},
)
case(
    "slurm-sbatch-gres",
    "`extra_sbatch_options: ['--gres=gpu:8']` (GPUs come from resource_spec)",
    "sbatch option '--gres=gpu:8' is not allowed: use resource_spec.num_of_gpus instead",
    slurm={"extra_sbatch_options": ["--gres=gpu:8"]},
)
case(
    "slurm-sbatch-short-form",
    "`extra_sbatch_options: ['-C', 'a100']` (short options)",
    "sbatch option '-C' is not allowed: write options in their long form, one item each (--name=value)",
    slurm={"extra_sbatch_options": ["-C", "a100"]},
)
case(
    "slurm-sbatch-value-missing",
    "`extra_sbatch_options: ['--constraint']` (no value)",
    "sbatch option '--constraint' needs a value: write it as --constraint=<value>",
    slurm={"extra_sbatch_options": ["--constraint"]},
)
case(
    "slurm-sbatch-flag-with-value",
    "`extra_sbatch_options: ['--exclusive=user']`",
    "sbatch option --exclusive takes no value",
    slurm={"extra_sbatch_options": ["--exclusive=user"]},
)
case(
    "slurm-sbatch-newline",
    "an extra sbatch option with a line break (a second #SBATCH line)",
    "contains a line break",
    slurm={"extra_sbatch_options": ["--comment=x\n#SBATCH --output=/etc/passwd"]},
)
case(
    "slurm-sbatch-string",
    "`extra_sbatch_options: '--exclusive'` (a string, not a list)",
    "extra_sbatch_options (site 'site-1'): must be a list, got str",
    slurm={"extra_sbatch_options": "--exclusive"},
)
# --- environment and secrets -------------------------------------------------------------------
case(
    "slurm-env-slurm-variable",
    "`env: {SLURM_JOB_ID: '1'}` (SLURM's own variable)",
    "'SLURM_JOB_ID' is reserved",
    slurm={"env": {"SLURM_JOB_ID": "1"}},
)
case(
    "slurm-env-flare-variable",
    "`env: {FLARE_OUTPUT: /tmp/x}` (the Client API's variable)",
    "'FLARE_OUTPUT' is reserved",
    slurm={"env": {"FLARE_OUTPUT": "/tmp/x"}},
)
case(
    "slurm-env-rank",
    "`env: {RANK: '0'}` (set per rank by flare-airflow)",
    "RANK is set by flare-airflow for each rank of a site job",
    slurm={"env": {"RANK": "0"}},
)
case(
    "slurm-env-number",
    "`env: {OMP_NUM_THREADS: 4}` (a number)",
    "env.OMP_NUM_THREADS (site 'site-1'): must be a string, got the number 4 (quote it: '4')",
    slurm={"env": {"OMP_NUM_THREADS": 4}},
)
case(
    "slurm-secret-value",
    "`secret_env: {HF_TOKEN: hf_abc123}` (the secret itself)",
    "secret_env.HF_TOKEN must be a reference {conn_id: <connection>, field: <field>} or {variable: <key>}, "
    "never the value itself",
    slurm={"secret_env": {"HF_TOKEN": "hf_abc123"}},
)
case(
    "slurm-secret-kubernetes-shape",
    "`secret_env: {HF_TOKEN: {secret: hf, key: token}}` (a Kubernetes reference on a SLURM site)",
    "unknown key 'secret'; allowed keys: conn_id, field, variable",
    slurm={"secret_env": {"HF_TOKEN": {"secret": "hf", "key": "token"}}},
)
case(
    "slurm-env-and-secret",
    "the same name in env and secret_env",
    "TOKEN set in both env and secret_env; keep one",
    slurm={"env": {"TOKEN": "x"}, "secret_env": {"TOKEN": {"variable": "token"}}},
)
# --- paths, trainer, timeouts ------------------------------------------------------------------
case(
    "slurm-output-dir-empty",
    "`output_dir: ''`",
    "output_dir must be a path without line breaks",
    slurm={"output_dir": ""},
)
case(
    "slurm-cwd-newline",
    "a working directory with a line break",
    "cwd must be a path without line breaks",
    slurm={"cwd": "/scratch\n/other"},
)
case(
    "slurm-trainer-command-string",
    "`trainer_command: 'python -u'` (a shell string)",
    "must be a list of arguments, not a string",
    slurm={"trainer_command": "python -u"},
)
case(
    "slurm-trainer-command-empty",
    "`trainer_command: []`",
    "must not be empty (leave it out for the job's trainer.command)",
    slurm={"trainer_command": []},
)
case(
    "slurm-script-missing-locally",
    "a local SLURM site whose trainer.script does not exist (and no trainer_script of its own)",
    "trainer.script '/nonexistent/train.py' does not exist",
    script="/nonexistent/train.py",
)
case(
    "slurm-pending-timeout-zero",
    "`pending_timeout: 0`",
    "pending_timeout must be a number of seconds > 0",
    slurm={"pending_timeout": 0},
)
case(
    "slurm-poll-interval-string",
    "`poll_interval: 2s`",
    "poll_interval (site 'site-1'): must be a number, got str '2s'",
    slurm={"poll_interval": "2s"},
)
case(
    "slurm-unknown-key",
    "`gpus: 2` in launcher_spec.slurm (GPUs belong in resource_spec)",
    "unknown key 'gpus'; allowed keys: connection, partition, account, qos, time_limit, nodes",
    slurm={"gpus": 2},
)
# --- what the site asks for --------------------------------------------------------------------
case(
    "slurm-gpus-without-manager",
    "`resource_spec: {num_of_gpus: 1}` without a resource_manager",
    "declares no resource_manager: add resource_manager: {type: gpu, num_of_gpus: <the site's GPUs>}, "
    "or {type: passthrough}",
    site={"resource_spec": {"num_of_gpus": 1}},
)
case(
    "slurm-gpus-more-than-site",
    "8 GPUs per job on a site whose resource_manager has 4",
    "a site job asks for 8 GPUs but the site has only 4",
    site={"resource_spec": {"num_of_gpus": 8}, "resource_manager": {"type": "gpu", "num_of_gpus": 4}},
)


def _job(bad: Bad) -> dict[str, Any]:
    slurm = {**BASE_SLURM, **bad.slurm}
    site = {"launcher": "slurm", "launcher_spec": {"slurm": slurm}, **bad.site}
    return {
        "job": "demo",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": str(INITIAL_MODEL),
        "trainer": {"script": bad.script},
        "sites": {"site-1": site},
    }


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_slurm_spec(case: Case, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(INPUTS[case.id]), sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_job(path)
    message = str(info.value)
    assert str(path) in message, message
    if case.id != "slurm-script-missing-locally":  # a job-level check: it names trainer.script
        assert "sites.site-1" in message, message  # the field, the site
    assert len(message) <= MAX_MESSAGE, message
    assert_clear(case, message)


def test_the_valid_base_site_loads(tmp_path: pathlib.Path) -> None:
    """The cases above fail because of their one change, not because the base is broken."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(Bad()), sort_keys=False))
    spec = load_job(path).sites["site-1"]
    assert spec.launcher == "slurm"
    assert spec.launcher_spec.slurm.partition == "gpu"
    assert spec.launcher_spec.slurm.time_limit == "01:00:00"
