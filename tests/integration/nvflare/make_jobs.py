"""Export NVFlare 2.9 jobs with NVFlare's own Job API and recipes, and run some in its simulator.

Runs in NVFlare's side environment (flare_airflow_testing/side_venvs.py), never the project's:

    python make_jobs.py OUT_DIR SCRIPT [--simulate]

Writes OUT_DIR/jobs/<name>/ for every job below; with ``--simulate`` also runs the FedAvg jobs in
NVFlare's simulator (2 clients) and copies each final model to OUT_DIR/<name>.npy. The last
stdout line is ``RESULT {json}``. The simulations run side by side, one process each (``--simulate-one
NAME``): a simulation mostly waits on NVFlare's own polling, and each has a workspace of its own.

* ``hello-full``: ``NumpyFedAvgRecipe``, in-process Client API executor (2.9's ScriptRunner), FULL;
* ``hello-diff``: the same recipe with ``launch_external_process=True`` (the launcher-executor
  shape of NVFlare 2.5-2.8: ``ClientAPILauncherExecutor`` + ``SubprocessLauncher``) and DIFF;
* ``cyclic-filtered``: ``FedJob`` with a ``CyclicController`` and a result filter (refused).
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
from nvflare.app_common.np.recipes import NumpyFedAvgRecipe
from nvflare.client.config import TransferType
from nvflare.recipe import SimEnv

ROUNDS = 2
SITES = 2
INITIAL = np.arange(1, 10, dtype=np.float32).reshape(3, 3)


def recipe(name, script, **kwargs):
    return NumpyFedAvgRecipe(
        name=name, min_clients=SITES, num_rounds=ROUNDS, model=INITIAL, train_script=script, **kwargs
    )


def cyclic_job(script):
    from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy
    from nvflare.app_common.workflows.cyclic_ctl import CyclicController
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.defs import FilterType
    from nvflare.job_config.script_runner import ScriptRunner

    job = FedJob(name="cyclic-filtered", min_clients=SITES)
    job.to_server(CyclicController(num_rounds=ROUNDS))
    for i in range(1, SITES + 1):
        job.to(ScriptRunner(script=script), f"site-{i}")
        job.to(PercentilePrivacy(), f"site-{i}", filter_type=FilterType.TASK_RESULT, tasks=["train"])
    return job


def fedavg_recipes(script):
    return {
        "hello-full": recipe("hello-full", script),
        "hello-diff": recipe(
            "hello-diff", script, launch_external_process=True, params_transfer_type=TransferType.DIFF
        ),
    }


def simulate_one(out, script, name):
    workspace = os.path.join(out, "sim", name)
    fedavg_recipes(script)[name].run(SimEnv(num_clients=SITES, workspace_root=workspace))
    final = os.path.join(workspace, name, "server", "simulate_job", "models", "server.npy")
    shutil.copyfile(final, os.path.join(out, f"{name}.npy"))


def main(out, script, simulate):
    jobs = os.path.join(out, "jobs")
    result = {"jobs": {}, "final": {}}
    fedavg = fedavg_recipes(script)
    for name, r in fedavg.items():
        r.export(jobs)
        result["jobs"][name] = os.path.join(jobs, name)
    job = cyclic_job(script)
    job.export_job(jobs)
    result["jobs"]["cyclic-filtered"] = os.path.join(jobs, "cyclic-filtered")
    if simulate:
        runs = {
            name: subprocess.Popen([sys.executable, __file__, out, script, "--simulate-one", name]) for name in fedavg
        }
        failed = {name: code for name, proc in runs.items() if (code := proc.wait()) != 0}
        if failed:
            sys.exit(f"NVFlare's simulator runs failed (exit codes): {failed}")
        result["final"] = {name: os.path.join(out, f"{name}.npy") for name in fedavg}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[3:4] == ["--simulate-one"]:
        simulate_one(sys.argv[1], sys.argv[2], sys.argv[4])
    else:
        main(sys.argv[1], sys.argv[2], "--simulate" in sys.argv[3:])
