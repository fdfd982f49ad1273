"""docs/architecture.md stays honest: every path it links exists, and it names every backend."""

from __future__ import annotations

import pathlib
import re

from flare_airflow.core.backends import BACKENDS

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_linked_path_exists() -> None:
    links = _LINK.findall(DOC.read_text(encoding="utf-8"))
    assert len(links) > 30
    missing = [link for link in links if not (DOC.parent / link).exists()]
    assert missing == [], f"docs/architecture.md links paths that do not exist: {missing}"


def test_every_backend_package_is_linked() -> None:
    text = DOC.read_text(encoding="utf-8")
    packages = sorted(p.parent.name for p in (DOC.parents[1] / "flare_airflow" / "launchers").glob("*/__init__.py"))
    assert len(packages) == len(BACKENDS), "one launcher package per registry entry"
    for package in packages:
        assert f"(../flare_airflow/launchers/{package})" in text, package
