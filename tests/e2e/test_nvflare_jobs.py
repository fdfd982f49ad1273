"""Jobs NVFlare 2.9 exported itself, imported and run by flare-airflow, equal to NVFlare's simulator.

``nvflare_exports`` (tests/integration/nvflare/fixtures.py) builds hello-numpy FedAvg jobs with
NVFlare's own recipe (FULL, in-process executor; DIFF, external-process executor) and runs them in
NVFlare's simulator. Here each is imported with ``flare-airflow import-nvflare`` and run with
``flare-airflow run``; the client script in both runs is the same unmodified file. Every number of
the job is a small multiple of 1/2, so the final models must be equal bit for bit.
"""

from __future__ import annotations

import json
import pathlib
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from flare_airflow_testing.harness import BIN, AirflowHome
from tests.integration.nvflare.fixtures import HELLO_CLIENT, ROUNDS

pytestmark = pytest.mark.e2e

SITES = ("site-1", "site-2")
INITIAL = np.arange(1, 10, dtype=np.float32).reshape(3, 3)
STEP_PER_ROUND = (1 * 1 + 3 * 3) / 4  # site-1 adds 1 with weight 1, site-2 adds 3 with weight 3


def import_nvflare(job_dir: str, out: pathlib.Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "flare-airflow"), "import-nvflare", job_dir, "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("name", ["hello-full", "hello-diff"])
def test_imported_job_runs_and_equals_nvflares_simulator(
    name: str, airflow_home: AirflowHome, nvflare_exports: dict
) -> None:
    out = airflow_home.dags / "nvflare"
    job_dir = nvflare_exports["jobs"][name]
    # NVFlare's recipe deploys one app to @ALL: the importer asks for the site names.
    refused = import_nvflare(job_dir, out)
    assert refused.returncode == 2 and "@ALL" in refused.stderr and "--sites site-1,site-2" in refused.stderr
    done = import_nvflare(job_dir, out, "--sites", ",".join(SITES))
    assert done.returncode == 0, done.stderr
    assert "launch_once" in done.stdout  # NVFlare's one-process-for-all-rounds, said at import
    job = (out / f"{name}.yaml").read_text()
    assert f"transfer: {'DIFF' if name == 'hello-diff' else 'FULL'}" in job
    # The unmodified file NVFlare's simulator ran is the one flare-airflow runs.
    assert (out / name / "custom" / HELLO_CLIENT.name).read_bytes() == HELLO_CLIENT.read_bytes()

    result = airflow_home.run(f"flare_{name.replace('-', '_')}", out / f"{name}_dag.py")
    expected = {"prepare", "publish", "verdict"} | {
        f"round_{r}.{t}" for r in range(1, ROUNDS + 1) for t in (*SITES, "global_model")
    }
    assert result.tasks == dict.fromkeys(expected, "success"), result.log[-3000:]
    assert result.returncode == 0

    final = load_file(result.state["published"]["final_model"].removeprefix("file://"))["numpy_key"]
    simulator = np.load(nvflare_exports["final"][name])
    assert final.dtype == simulator.dtype == np.float32
    np.testing.assert_array_equal(final, simulator)
    np.testing.assert_array_equal(final, INITIAL + ROUNDS * STEP_PER_ROUND)

    metrics = result.metrics()
    for r, entry in enumerate(metrics["rounds"]):
        assert entry["num_samples"] == 4  # NUM_STEPS_CURRENT_ROUND 1 + 3: NVFlare's aggregation weights
        # SummaryWriter scalars and the script's metrics, with NVFlare's 0-based round.
        assert entry["site_metrics"] == {"site-1": {"round": r, "step": 1.0}, "site-2": {"round": r, "step": 3.0}}
    run_dir = pathlib.Path(result.state["published"]["final_model"].removeprefix("file://")).parents[1]
    record = json.loads((run_dir / "round-0001" / "sites" / "site-2.json").read_text())
    assert record["params_type"] == ("DIFF" if name == "hello-diff" else "FULL")


def test_refusals_name_each_component_with_its_file_and_line(airflow_home: AirflowHome, nvflare_exports: dict) -> None:
    """A cyclic job with a privacy filter per site, exported by NVFlare's Job API: nothing is written.

    Its PercentilePrivacy filters carry over (as site policy): the cyclic workflow alone is refused."""
    out = airflow_home.dags / "nvflare-refused"
    done = import_nvflare(nvflare_exports["jobs"]["cyclic-filtered"], out)
    assert done.returncode == 2
    refusals = [line.strip() for line in done.stderr.splitlines() if ".json:" in line]
    assert len(refusals) == 1 and "PercentilePrivacy" not in done.stderr, done.stderr
    for refusal, component in zip(refusals, ["cyclic_ctl.CyclicController"], strict=True):
        where, _ = refusal.split(": ", 1)
        file, line = where.rsplit(":", 1)
        assert component in refusal and ("; " in refusal)  # what, why; what to do
        assert component.rsplit(".", 1)[-1] in pathlib.Path(file).read_text().splitlines()[int(line) - 1]
    assert not out.exists()
