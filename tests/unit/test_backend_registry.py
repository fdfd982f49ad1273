"""The backend registry (flare_airflow.core.backends) is the only place that knows backend names.

A backend is one package, one config block and one registry entry: these tests fail when code
elsewhere compares a backend name (a new backend would have to be added there too, and no type
checker would say where), or when an entry names something that does not exist.
"""

from __future__ import annotations

import ast
import pathlib
import typing

import pytest
from airflow.sdk import BaseOperator

from flare_airflow.core import backends
from flare_airflow.core.config import LauncherSpec
from flare_airflow.get_provider_info import get_provider_info

PACKAGE = pathlib.Path(backends.__file__).resolve().parents[1]
NAMES = set(backends.BACKENDS) | set(backends.ALIASES)


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for item in node.elts for s in _strings(item)]
    return []


def name_compares(source: str, names: set[str] = NAMES) -> list[tuple[int, str]]:
    """``(line, name)`` of every comparison (``==``, ``!=``, ``in``, ``not in``) against one of ``names``
    (by default the backends')."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, s) for s in _strings(operand) if s in names]
    return found


def test_the_scan_sees_the_compares_it_must_refuse() -> None:
    assert name_compares('if spec.launcher == "slurm": pass') == [(1, "slurm")]
    assert name_compares('ok = launcher not in ("k8s", "docker")') == [(1, "k8s"), (1, "docker")]
    assert name_compares('x = {"backend": "k8s"}') == []


def test_no_module_outside_the_registry_compares_backend_names() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: compares {name!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.resolve() != pathlib.Path(backends.__file__).resolve()
        for line, name in name_compares(path.read_text(encoding="utf-8"))
    ]
    assert offenders == [], "ask flare_airflow.core.backends instead:\n" + "\n".join(offenders)


@pytest.mark.parametrize("entry", list(backends.BACKENDS.values()), ids=list(backends.BACKENDS))
def test_every_entry_names_what_exists(entry: backends.Backend) -> None:
    assert entry.name in LauncherSpec.model_fields, f"launcher_spec has no {entry.name} block"
    site_task = backends.load(entry.site_task)
    assert issubclass(site_task, BaseOperator)
    # A pod or SLURM job reaches the store itself: staging it on the worker would hand the job
    # paths that exist only there (the pod task did so from the lifecycle merge until 2026-12-06).
    assert site_task.stages_store is entry.stages_store, f"{entry.name}: the site task and the registry disagree"
    for dotted in (entry.launcher, entry.trigger):
        if dotted is not None:
            assert callable(backends.load(dotted))
    if entry.sweep is not None:
        sweep = backends.load(entry.sweep[1])
        assert issubclass(sweep, BaseOperator) and sweep.sweep_doc
    operators = get_provider_info()["operators"][0]["python-modules"]
    assert entry.site_task.rpartition(".")[0] in operators
    # A backend with a sensor trigger names the trigger's module, and the provider info lists it.
    assert (entry.trigger is None) == (entry.trigger_module is None)
    if entry.trigger is not None:
        made = typing.get_type_hints(backends.load(entry.trigger))["return"]
        assert made.__module__ == entry.trigger_module
        assert entry.trigger_module in get_provider_info()["triggers"][0]["python-modules"]


def test_aliases_resolve_and_unknown_names_are_refused() -> None:
    assert backends.backend("kubernetes").name == "k8s"
    assert backends.backend("docker").name == backends.backend("podman").name == "container"
    with pytest.raises(KeyError, match="unknown backend 'nomad'; known: process, k8s, slurm, container"):
        backends.backend("nomad")


def test_sweeps_follow_the_sites_backends_in_registry_order() -> None:
    class Site:
        def __init__(self, launcher: str) -> None:
            self.launcher = launcher

    sites = {"a": Site("container"), "b": Site("process"), "c": Site("k8s"), "d": Site("container")}
    assert [task for task, _ in backends.sweeps(sites)] == ["sweep_pods", "sweep_containers"]
    from flare_airflow.operators.container import SweepContainersOperator

    assert sorted(backends.sites_swept_by(sites, SweepContainersOperator)) == ["a", "d"]
