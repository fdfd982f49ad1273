"""Render ``docs/bad-inputs.md`` from the battery's cases: ``python -m tests.bad_inputs.table``."""

from __future__ import annotations

import importlib
import pathlib
import sys

from tests.bad_inputs.cases import CATEGORIES, Case

HERE = pathlib.Path(__file__).resolve().parent
DOC = HERE.parents[1] / "docs" / "bad-inputs.md"


def all_cases() -> list[Case]:
    cases: list[Case] = []
    for path in sorted(HERE.glob("test_*.py")):
        module = importlib.import_module(f"tests.bad_inputs.{path.stem}")
        cases.extend(getattr(module, "CASES", []))
    return cases


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(cases: list[Case]) -> str:
    lines = [
        "# Bad inputs and the errors they get",
        "",
        "Every row is a test in `tests/bad_inputs/` (the test id is the first column). Each asserts that",
        "the user sees the error text shown (and no bare traceback), that no bad global model is",
        "published, and that one site's bad input never fails the round for the others.",
        "Regenerate with `python -m tests.bad_inputs.table` after adding a case.",
        "",
        f"{len(cases)} cases.",
    ]
    for key, title in CATEGORIES.items():
        rows = [c for c in cases if c.category == key]
        if not rows:
            continue
        lines += ["", f"## {title} ({len(rows)})", "", "| id | bad input | what the user is told |", "|---|---|---|"]
        lines += [f"| `{c.id}` | {_cell(c.bad_input)} | {_cell(c.error)} |" for c in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    DOC.write_text(render(all_cases()))
    print(f"wrote {DOC}", file=sys.stderr)
