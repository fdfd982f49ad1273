"""The layers: core < launchers < Airflow adapters, and a Client API that needs no Airflow."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_import_linter_contracts_are_kept() -> None:
    lint_imports = pathlib.Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), f"import-linter is not installed next to {sys.executable}"
    result = subprocess.run([str(lint_imports)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = re.search(r"Contracts: (\d+) kept, (\d+) broken", result.stdout)
    assert summary, result.stdout
    assert int(summary.group(1)) >= 9
    assert summary.group(2) == "0"
    for name in (
        "Layers: Airflow adapters > site task > launchers > core",
        "core, launchers and the site task never import Airflow",
        "The Client API needs only numpy and safetensors",
        "No import cycles inside core",
        "The command's back-ends sit below its commands",
        "try-trainer runs a trainer as a site task would, without the Airflow-side back-ends",
        "The test machinery sits below tests and benchmarks; benchmarks never import tests",
        "The test machinery never imports the benchmarks",
        "The provider never imports its tests, benchmarks or test machinery",
    ):
        # import-linter wraps long names over lines: compare with the whitespace folded.
        assert f"{name} KEPT" in " ".join(result.stdout.split()), f"contract {name!r} not kept"


def test_the_wheel_ships_the_provider_only() -> None:
    """The test machinery (flare_airflow_testing), tests and benchmarks stay out of the distribution."""
    # setuptools' own package finder, in a fresh interpreter: setuptools refuses to import once
    # another test has loaded the standard library's distutils.
    probe = (
        "import json, sys, tomllib; from setuptools import find_packages; "
        "find = tomllib.load(open('pyproject.toml', 'rb'))['tool']['setuptools']['packages']['find']; "
        "print(json.dumps(find_packages('.', include=find['include'])))"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    packages = json.loads(result.stdout)
    assert "flare_airflow" in packages and "flare_airflow.core" in packages
    assert not [p for p in packages if not (p == "flare_airflow" or p.startswith("flare_airflow."))], packages


def top_level_modules_after_importing(module: str) -> set[str]:
    result = subprocess.run([sys.executable, "-c", PROBE, module], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout))


@pytest.mark.parametrize(
    "module",
    [
        "flare_airflow",
        "flare_airflow.client",
        "flare_airflow.core.client",
        "flare_airflow.launchers.process",
        "flare_airflow.site_task.runner",
    ],
)
def test_lower_layers_do_not_load_airflow_or_pydantic(module: str) -> None:
    loaded = top_level_modules_after_importing(module)
    assert "flare_airflow" in loaded
    assert not loaded & {"airflow", "pydantic", "kubernetes", "sqlalchemy"}, sorted(loaded)


def test_the_kubernetes_launcher_loads_kubernetes_but_not_airflow() -> None:
    loaded = top_level_modules_after_importing("flare_airflow.launchers.kubernetes")
    assert "kubernetes" in loaded
    assert not loaded & {"airflow", "sqlalchemy"}, sorted(loaded)


def test_the_probe_sees_heavy_imports() -> None:
    """The configuration layer uses pydantic: the probe above would notice it."""
    assert "pydantic" in top_level_modules_after_importing("flare_airflow.core.config")


def test_the_site_runner_starts_the_trainer_before_loading_numpy() -> None:
    # Its imports stop short of numpy so that the trainer's interpreter starts while numpy loads
    # for the update check: the two start-ups overlap on every site job.
    loaded = top_level_modules_after_importing("flare_airflow.site_task.runner")
    assert "numpy" not in loaded and "safetensors" not in loaded, sorted(loaded)
