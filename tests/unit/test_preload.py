"""docs/scale.md's preload: Airflow's local settings import the provider at every component's start."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

from tests.unit.airflow_layer import make_job

REPO = pathlib.Path(__file__).resolve().parents[2]

PROBE = """
import json, os, sys
from pathlib import Path
import airflow  # Airflow's settings import $AIRFLOW_HOME/config/airflow_local_settings.py here
preloaded = "flare_airflow.builder" in sys.modules
# What a forked task process then imports at its first use of a file:// model store: without the
# preload, Airflow's filesystem registry imports every provider's filesystem module right here.
from airflow.sdk import ObjectStoragePath
before = set(sys.modules)
ObjectStoragePath("file:///").fs
store_imports = sorted(m for m in set(sys.modules) - before if m.startswith("airflow.providers."))
from airflow.dag_processing.dagbag import BundleDagBag
dag_file = Path(sys.argv[1])
bag = BundleDagBag(dag_folder=str(dag_file), safe_mode=False, bundle_path=dag_file.parent, bundle_name="dags")
print("RESULT " + json.dumps({
    "preloaded": preloaded,
    "store_imports": store_imports,
    "dags": {d: len(dag.tasks) for d, dag in bag.dags.items()},
    "errors": {str(k): str(v) for k, v in bag.import_errors.items()},
}))
"""


def _documented_settings() -> str:
    text = (REPO / "docs" / "scale.md").read_text()
    block = re.search(r"```python\n(# \$AIRFLOW_HOME/config/airflow_local_settings\.py\n.*?)```", text, re.S)
    assert block, "docs/scale.md lost its airflow_local_settings.py block"
    return block.group(1)


def test_the_documented_local_settings_preload_the_provider_and_dags_still_parse(tmp_path) -> None:
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "airflow_local_settings.py").write_text(_documented_settings())
    make_job(tmp_path)  # its trainer script and initial model
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        json.dumps(
            {
                "job": "pre",
                "rounds": 2,
                "min_clients": 2,
                "initial_model": "init.safetensors",
                "trainer": {"script": "train.py"},
                "store": str(tmp_path / "store"),
                "sites": {"site-1": {}, "site-2": {}},
            }
        )
    )
    dag_file = tmp_path / "dags" / "preload_dag.py"
    dag_file.parent.mkdir()
    dag_file.write_text(
        f"from flare_airflow.builder import build_dag\ndag = build_dag({str(job_file)!r}, dag_id='pre')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CORE__UNIT_TEST_MODE="False")
    # What a site task's process parses: Airflow's parsing context names the task.
    env.update(_AIRFLOW_PARSING_CONTEXT_DAG_ID="pre", _AIRFLOW_PARSING_CONTEXT_TASK_ID="round_1.site-2")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(dag_file)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    result = json.loads(line[len("RESULT ") :])
    # prepare, publish, verdict and each round's site-2 and global_model: only the running site's tasks.
    # Airflow's filesystem registry was built by the preload: a first store use imports no provider.
    assert result == {"preloaded": True, "store_imports": [], "dags": {"pre": 7}, "errors": {}}
