"""docs/bad-inputs.md lists exactly the battery's cases, and each id is unique."""

from __future__ import annotations

from collections import Counter

from tests.bad_inputs.table import DOC, all_cases, render


def test_case_ids_are_unique() -> None:
    counts = Counter(c.id for c in all_cases())
    assert [i for i, n in counts.items() if n > 1] == []


def test_the_docs_table_is_generated_from_the_cases() -> None:
    assert DOC.read_text() == render(all_cases()), "docs/bad-inputs.md is stale: python -m tests.bad_inputs.table"
