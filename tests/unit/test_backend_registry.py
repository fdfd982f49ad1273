"""The backend registry (flare_airflow.core.backends, bound to Airflow in
flare_airflow.operators.bindings) is the only place that knows backend names.

A backend is one package, one config block, one core entry and one binding: these tests fail when
code elsewhere compares a backend name (a new backend would have to be added there too, and no type
checker would say where), or when an entry and its binding disagree. The scan is shared with the
strategy and filter registries' tests (tests/unit/core/aggregation/test_strategy_registry.py,
tests/unit/core/test_filter_registry.py): none of the three is chosen by name outside its registry.
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
from flare_airflow.operators import bindings

PACKAGE = pathlib.Path(backends.__file__).resolve().parents[1]
NAMES = set(backends.BACKENDS) | set(backends.ALIASES)


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for item in node.elts for s in _strings(item)]
    return []


def name_compares(source: str, names: set[str] = NAMES) -> list[tuple[int, str]]:
    """``(line, name)`` of every choice by one of ``names`` (by default the backends'): a comparison
    (``==``, ``!=``, ``in``, ``not in``) or a ``match`` arm (``case "slurm":``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, s) for s in _strings(operand) if s in names]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, s) for s in _strings(node.value) if s in names]
    return found


def test_the_scan_sees_the_compares_it_must_refuse() -> None:
    assert name_compares('if spec.launcher == "slurm": pass') == [(1, "slurm")]
    assert name_compares('ok = launcher not in ("k8s", "docker")') == [(1, "k8s"), (1, "docker")]
    assert name_compares('x = {"backend": "k8s"}') == []
    match_arm = 'match spec.launcher:\n    case "slurm":\n        pass\n    case "k8s" | "docker":\n        pass'
    assert name_compares(match_arm) == [(2, "slurm"), (4, "k8s"), (4, "docker")]


def test_no_module_outside_the_registry_compares_backend_names() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: compares {name!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.resolve() != pathlib.Path(backends.__file__).resolve()
        for line, name in name_compares(path.read_text(encoding="utf-8"))
    ]
    assert offenders == [], "ask flare_airflow.core.backends instead:\n" + "\n".join(offenders)


def test_every_core_entry_has_exactly_one_binding() -> None:
    assert list(bindings.BINDERS) == list(backends.BACKENDS)


@pytest.mark.parametrize("entry", list(backends.BACKENDS.values()), ids=list(backends.BACKENDS))
def test_every_entry_and_its_binding_agree(entry: backends.Backend) -> None:
    assert entry.name in LauncherSpec.model_fields, f"launcher_spec has no {entry.name} block"
    bound = bindings.binding(entry.name)
    assert issubclass(bound.site_task, BaseOperator)
    # A pod or SLURM job reaches the store itself: staging it on the worker would hand the job
    # paths that exist only there (the pod task did so from the lifecycle merge until 2026-12-06).
    stages = getattr(bound.site_task, "stages_store", None)
    assert stages is entry.stages_store, f"{entry.name}: the site task and the registry disagree"
    # A sensor finds a watchable backend's jobs through its launcher factory, and only those.
    assert (bound.launcher is not None) is entry.watchable
    if bound.sweep is not None:
        assert issubclass(bound.sweep[1], BaseOperator) and bound.sweep[1].sweep_doc
    assert bound.site_task.__module__ in get_provider_info()["operators"][0]["python-modules"]
    if bound.trigger is not None:  # the trigger's module is one Airflow's triggerer may import
        made = typing.get_type_hints(bound.trigger)["return"]
        assert made.__module__ in get_provider_info()["triggers"][0]["python-modules"]


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
    assert [task for task, _ in bindings.sweeps(sites)] == ["sweep_pods", "sweep_containers"]
    from flare_airflow.operators.container import SweepContainersOperator

    assert sorted(bindings.sites_swept_by(sites, SweepContainersOperator)) == ["a", "d"]
