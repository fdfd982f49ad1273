"""End-to-end harness: a private Airflow home (SQLite, embedded default) and real `airflow dags test` runs.

Each scenario writes a job YAML and a one-line DAG file into its own folder and runs it with
``flare-airflow run --dagfile ... --json``, which reports every task instance's final state from
the metadata database (``airflow dags test`` itself exits 0 even when a task failed).
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml
from safetensors.numpy import save_file

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
# The e2e tier's trainer scripts, read as files (this package never imports the tests).
TRAINERS = REPO / "tests" / "e2e" / "trainers"


class _MigratedSqlite:
    """The first home's SQLite database right after ``airflow db migrate``; later homes in this
    process copy it (a file copy against ~10 s of migration), as stack.py restores PostgreSQL."""

    def __init__(self) -> None:
        self.copy: pathlib.Path | None = None

    def migrate(self, home: AirflowHome) -> None:
        if self.copy is not None:
            home.home.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.copy, home.home / "airflow.db")
            return
        out = subprocess.run(
            [str(BIN / "airflow"), "db", "migrate"], env=home.env, capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        keep = pathlib.Path(tempfile.mkdtemp(prefix="flare-migrated-sqlite-"))
        atexit.register(shutil.rmtree, keep, True)
        shutil.copyfile(home.home / "airflow.db", keep / "airflow.db")
        self.copy = keep / "airflow.db"


_MIGRATED_SQLITE = _MigratedSqlite()


@dataclass
class RunResult:
    state: dict[str, Any]
    log: str
    returncode: int
    stderr: str = ""

    @property
    def tasks(self) -> dict[str, str]:
        return {t: info["state"] for t, info in self.state["tasks"].items()}

    def metrics(self) -> dict[str, Any]:
        uri = self.state["published"]["metrics"]
        return json.loads(pathlib.Path(uri.removeprefix("file://")).read_text())


class AirflowHome:
    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.home = root / "airflow"
        self.dags = root / "dags"
        self.dags.mkdir(parents=True)
        self.env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "PYTHONWARNINGS": "ignore::DeprecationWarning",
        }
        _MIGRATED_SQLITE.migrate(self)

    @property
    def store(self) -> pathlib.Path:
        return self.home / "flare_store"

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.home / 'airflow.db'}"

    def copy_repo_dags(self, name: str) -> pathlib.Path:
        """The repository's dags/ as ``dags/<name>``, with ../examples beside it as the job files expect.

        The session's Airflow home is shared by every module on a pytest worker: examples/ is copied
        once, whichever module comes first.
        """
        folder = self.dags / name
        shutil.copytree(REPO / "dags", folder, ignore=shutil.ignore_patterns("__pycache__"))
        examples = self.dags / "examples"
        if not examples.exists():
            shutil.copytree(REPO / "examples", examples, ignore=shutil.ignore_patterns("__pycache__"))
        return folder

    def write_job(self, name: str, job: dict[str, Any], dag_code: str | None = None) -> pathlib.Path:
        folder = self.dags / name
        folder.mkdir()
        (folder / "job.yaml").write_text(yaml.safe_dump(job))
        code = dag_code or (
            "from pathlib import Path\n"
            "from flare_airflow.builder import build_dag\n"
            "dag = build_dag(Path(__file__).with_name('job.yaml'))\n"
        )
        dag_file = folder / "dag.py"
        dag_file.write_text(textwrap.dedent(code))
        return dag_file

    def run(
        self,
        dag_id: str,
        dag_file: pathlib.Path | None = None,
        conf: dict[str, Any] | None = None,
        site_policy: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> RunResult:
        """Run ``dag_id`` once; ``site_policy`` (``{"sites": {...}}``) is the workers' site policy
        file (``FLARE_SITE_CONFIG``) for this run only; ``env`` adds variables for this run only."""
        log = self.root / f"{dag_id}-{len(list(self.root.glob('*.log')))}.log"
        run_env = self.env
        if site_policy is not None:
            policy = log.with_suffix(".policy.yaml")
            policy.write_text(yaml.safe_dump(site_policy))
            run_env = {**self.env, "FLARE_SITE_CONFIG": str(policy)}
        cmd = [str(BIN / "flare-airflow"), "run", dag_id, "--json", "--log", str(log)]
        if dag_file is not None:  # relative, as a user types it (Airflow itself needs it absolute)
            cmd += ["--dagfile", os.path.relpath(dag_file, self.root)]
        if conf:
            cmd += ["--conf", json.dumps(conf)]
        out = subprocess.run(
            cmd,
            env={**run_env, **(env or {})},
            capture_output=True,
            text=True,
            check=False,
            timeout=900,
            cwd=self.root,
        )
        assert out.stdout.strip(), f"no output from flare-airflow run: {out.stderr[-3000:]}"
        state = json.loads(out.stdout)
        return RunResult(state=state, log=log.read_text(), returncode=out.returncode, stderr=out.stderr)


def tiny_model(path: pathlib.Path) -> pathlib.Path:
    save_file({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}, str(path))
    return path


def behave_job(root: pathlib.Path, name: str, sites: int, rounds: int, min_clients: int, args: list[str]) -> dict:
    return {
        "job": name,
        "rounds": rounds,
        "min_clients": min_clients,
        "initial_model": str(tiny_model(root / f"{name}-init.safetensors")),
        "trainer": {"script": str(TRAINERS / "behave.py"), "args": args, "shutdown_timeout": 2},
        "sites": {"@default": {"retries": 0}, **{f"site-{i}": {} for i in range(1, sites + 1)}},
    }
