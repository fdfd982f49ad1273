"""The strategy registry (``STRATEGIES``, read off the ``aggregator`` union) is the only place that
knows strategy names: a strategy is its module, its class in ``core/config/aggregator.py``, its docs
and its tests. These tests fail when code elsewhere chooses a strategy by comparing its name, or
when an entry is not whole."""

from __future__ import annotations

import pathlib

import pytest
from pydantic import ValidationError

from flare_airflow.core.aggregation.strategies import Strategy
from flare_airflow.core.config import aggregator
from flare_airflow.core.config.aggregator import STRATEGIES, aggregator_spec
from tests.unit.test_backend_registry import PACKAGE, name_compares

DOCS = pathlib.Path(__file__).resolve().parents[4] / "docs" / "strategies.md"
# The smallest valid block of each strategy (its required parameters).
MINIMAL = {"trimmed_mean": {"beta": 0.2}, "krum": {"f": 1}}


def test_the_scan_sees_a_strategy_chosen_by_name() -> None:
    assert name_compares('if spec.name == "krum": pass', set(STRATEGIES)) == [(1, "krum")]


def test_no_module_chooses_a_strategy_by_its_name() -> None:
    home = pathlib.Path(aggregator.__file__).resolve()
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: compares {name!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.resolve() != home
        for line, name in name_compares(path.read_text(encoding="utf-8"), set(STRATEGIES))
    ]
    assert offenders == [], "give the strategy's class in core/config/aggregator.py a method instead:\n" + "\n".join(
        offenders
    )


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_entry_builds_its_strategy_and_is_documented(name: str) -> None:
    spec = aggregator_spec({"name": name, **MINIMAL.get(name, {})})
    assert type(spec) is STRATEGIES[name] and spec.name == name and spec.label
    strategy = spec.strategy()
    assert isinstance(strategy, Strategy) and strategy.name == name.replace("fedprox", "fedavg")
    assert f"`{name}`" in DOCS.read_text(encoding="utf-8"), f"docs/strategies.md does not describe {name}"
    required = [k for k, f in STRATEGIES[name].model_fields.items() if f.is_required() and k != "name"]
    assert sorted(required) == sorted(MINIMAL.get(name, {})), "MINIMAL lists each strategy's required parameters"


def test_a_parameter_is_refused_by_every_strategy_that_does_not_take_it() -> None:
    for name, spec in STRATEGIES.items():
        for other in STRATEGIES.values():
            for key in set(other.model_fields) - set(spec.model_fields):
                with pytest.raises(ValidationError, match=f"'{key}' is not a parameter of '{name}'"):
                    aggregator_spec({"name": name, **MINIMAL.get(name, {}), key: 1})


def test_an_empty_block_is_fedavg_and_parameters_are_what_the_job_set() -> None:
    assert aggregator_spec({}).name == "fedavg" and aggregator_spec(None).parameters() == {}
    assert aggregator_spec({"name": "fedadam", "eta": 0.5}).parameters() == {"eta": 0.5}
