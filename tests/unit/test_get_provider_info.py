"""The provider metadata lists exactly the modules that hold operators and triggers, and they import."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger

import flare_airflow.operators
import flare_airflow.sensors
import flare_airflow.triggers
from flare_airflow.get_provider_info import get_provider_info

INFO = get_provider_info()


def listed(kind: str) -> list[str]:
    return [module for entry in INFO.get(kind, []) for module in entry["python-modules"]]


def defining(package: object, base: type) -> set[str]:
    """Modules of ``package`` that define a subclass of ``base`` (helpers such as operators.common do not)."""
    found = set()
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):  # type: ignore[attr-defined]
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == module.__name__ and issubclass(obj, base):
                found.add(module.__name__)
    return found


@pytest.mark.parametrize("module", listed("operators") + listed("sensors") + listed("triggers") + listed("hooks"))
def test_every_listed_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_every_operator_module_is_listed() -> None:
    assert sorted(listed("operators")) == sorted(defining(flare_airflow.operators, BaseOperator))


def test_every_sensor_module_is_listed() -> None:
    assert listed("sensors") == ["flare_airflow.sensors.site_job"]
    assert sorted(listed("sensors")) == sorted(defining(flare_airflow.sensors, BaseOperator))


def test_every_trigger_module_is_listed() -> None:
    assert sorted(listed("triggers")) == sorted(defining(flare_airflow.triggers, BaseTrigger))


def test_package_name_and_version() -> None:
    from flare_airflow import __version__

    assert INFO["package-name"] == "flare-airflow"
    assert INFO["versions"] == [__version__]


def test_the_metadata_is_valid_for_airflow() -> None:
    import json
    import pathlib

    import airflow
    import jsonschema

    schema = json.loads((pathlib.Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(INFO, schema)


def test_every_flare_airflow_setting_read_is_declared() -> None:
    import pathlib
    import re

    package = pathlib.Path(flare_airflow.operators.__file__).parent.parent
    read = {
        match
        for path in package.rglob("*.py")
        for match in re.findall(r"""conf\.get\(\s*["']flare_airflow["'],\s*["'](\w+)["']""", path.read_text())
    }
    assert read, "the pattern found no setting: the test would pass on anything"
    assert read == set(INFO["config"]["flare_airflow"]["options"])
