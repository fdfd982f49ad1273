"""The filter registry (``FILTERS`` in core/privacy/filters.py, and the job file's ``FilterSpec`` union
that points into it) is the only place that knows filter types: a filter is its class, its config
entry, its docs and its tests. These tests fail when code elsewhere chooses a filter by comparing
its type, or when an entry is not whole."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest

from flare_airflow.core.config.filters import FILTER_SPECS, FILTER_TYPES
from flare_airflow.core.config.privacy import SitePrivacy
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.privacy.filters import FILTERS, UpdateInFilter, site_filter
from tests.unit.test_backend_registry import PACKAGE, name_compares

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "privacy.md"
# The smallest valid entry of each filter (its required parameters).
MINIMAL = {
    "exclude_vars": {"names": ["w"]},
    "clip": {"clip": 1.0},
    "gaussian": {"clip": 1.0, "noise_multiplier": 1.0},
    "percentile": {},
}


def test_the_scan_sees_a_filter_chosen_by_its_type() -> None:
    assert name_compares('if step.type == "gaussian": pass', set(FILTERS)) == [(1, "gaussian")]
    assert name_compares('noisy = f["type"] in ("clip", "percentile")', set(FILTERS)) == [
        (1, "clip"),
        (1, "percentile"),
    ]


def test_no_module_chooses_a_filter_by_its_type() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: compares {name!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, name in name_compares(path.read_text(encoding="utf-8"), set(FILTERS))
    ]
    assert offenders == [], "give the filter's class in core/privacy/filters.py a method instead:\n" + "\n".join(
        offenders
    )


def test_the_job_file_names_exactly_the_registered_filters() -> None:
    assert tuple(FILTERS) == FILTER_TYPES
    assert SitePrivacy().allow_job_filters == list(FILTERS)


@pytest.mark.parametrize("kind", list(FILTERS))
def test_every_entry_configures_its_filter_and_is_documented(kind: str) -> None:
    entry = FILTER_SPECS[kind].model_validate({"type": kind, **MINIMAL[kind]})
    made = entry.site_filter()
    # The config entry's fields are the filter's parameters: the plan carries the entry's dump.
    assert type(made) is FILTERS[kind] is entry.applies and made.type == kind
    assert {f.name for f in dataclasses.fields(made)} == set(entry.model_dump()) - {"type"}
    assert site_filter(entry.model_dump()) == made
    assert f"| `{kind}` |" in DOCS.read_text(encoding="utf-8"), f"docs/privacy.md's filter table lacks {kind}"
    # One method applies it, and it leaves one record naming its type on the update it touched.
    update = UpdateInFilter(diff={"w": np.array([3.0, 4.0])}, excluded=frozenset(), key=b"k" * 32)
    made.apply(update, 0)
    assert [r["type"] for r in update.applied] == [kind]
    assert entry.noise() == made.noise() and (made.noise() is not None) == (update.digests != [])


def test_a_plan_naming_an_unknown_filter_or_parameter_is_refused_saying_what_is_known() -> None:
    with pytest.raises(FlareAirflowError, match=r"unknown filter type 'blur'; the filters are exclude_vars, clip"):
        site_filter({"type": "blur"})
    with pytest.raises(
        FlareAirflowError, match=r"plan: 'z' is not a parameter of the gaussian filter; it takes clip, noise"
    ):
        site_filter({"type": "gaussian", "clip": 1.0, "z": 2.0})
