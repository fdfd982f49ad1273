"""The FLARE_* variable names have one home: flare_airflow/core/envvars.py."""

from __future__ import annotations

import pathlib
import re

from flare_airflow.core import envvars

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "flare_airflow"
# A quoted FLARE_<NAME> that is a whole variable name (not the reserved prefix, not a log marker).
NAME_LITERAL = re.compile(r"""["'](FLARE_[A-Z0-9_]*[A-Z0-9])["']""")


def test_every_constant_is_named_after_its_value() -> None:
    names = {name: value for name, value in vars(envvars).items() if name.startswith("FLARE_")}
    assert names, "no FLARE_* constants"
    assert all(name == value for name, value in names.items()), names
    assert set(envvars.CLIENT_API_VARS) | set(envvars.STORE_PATH_VARS) <= set(names.values())


def test_no_module_spells_a_variable_name_itself() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {match.group(1)}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "envvars.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in NAME_LITERAL.finditer(line)
    ]
    assert not found, "use flare_airflow.core.envvars instead of:\n" + "\n".join(found)
