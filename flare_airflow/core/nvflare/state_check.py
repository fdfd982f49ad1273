"""Find what an NVFlare Client API script keeps in memory across rounds.

NVFlare starts a script once per job and its ``while flare.is_running():`` loop runs every round
in that one process (the executor's ``launch_once``, and the in-process default). flare-airflow
starts the script once per (run, round, site): the loop body runs once, and whatever the script
built before the loop is built afresh each round. That is right for a model whose weights come
from the global model each round; it silently changes the training when the script carries state
across rounds. This check reads the script's source (it never runs it) and names what it sees:

* a name bound before the loop and accumulated inside it (``steps += n``, ``history.append(...)``);
* an optimizer or learning-rate scheduler built before the loop (momentum, Adam moments and the
  schedule's step restart every round).

It cannot see everything (state in objects, files, closures); the docs say so.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

_GROWING_METHODS = frozenset({"append", "extend", "update", "add", "insert", "step"})
_STATEFUL_CALLS = ("optim.", "lr_scheduler", "Optimizer", "Scheduler")


@dataclass(frozen=True)
class StateFinding:
    line: int
    message: str

    def describe(self, script: str) -> str:
        return f"{script}:{self.line}: {self.message}"


def _is_running_loop(node: ast.AST) -> bool:
    if not isinstance(node, ast.While):
        return False
    test = node.test
    return (
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Attribute | ast.Name)
        and (test.func.attr if isinstance(test.func, ast.Attribute) else test.func.id) == "is_running"
    )


def _bound_names(statements: list[ast.stmt]) -> dict[str, tuple[int, ast.AST]]:
    bound: dict[str, tuple[int, ast.AST]] = {}
    for stmt in statements:
        targets: list[ast.expr] = []
        value: ast.AST | None = None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name) and value is not None:
                    bound[name.id] = (stmt.lineno, value)
    return bound


def _stateful_value(value: ast.AST) -> str | None:
    for node in ast.walk(value):
        if isinstance(node, ast.Call):
            text = ast.unparse(node.func)
            if any(marker in text for marker in _STATEFUL_CALLS):
                return text
    return None


def _check_body(statements: list[ast.stmt]) -> list[StateFinding]:
    findings: list[StateFinding] = []
    for index, stmt in enumerate(statements):
        if not _is_running_loop(stmt):
            continue
        assert isinstance(stmt, ast.While)
        before = _bound_names(statements[:index])
        for bound, (bound_line, value) in before.items():
            made_by = _stateful_value(value)
            if made_by:
                findings.append(
                    StateFinding(
                        bound_line,
                        f"{bound!r} ({made_by}) is built once before the is_running() loop: under flare-airflow it is "
                        "built afresh each round (one process per round), so its state (momentum, moments, the "
                        "schedule's step) does not carry over; rebuild it per round on purpose or keep the state "
                        "in the model",
                    )
                )
        seen: set[tuple[str, int]] = set()
        for node in ast.walk(stmt):
            name: str | None = None
            line: int | None = None
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                name, line = node.target.id, node.lineno
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.attr in _GROWING_METHODS
                and not _stateful_value(before.get(node.func.value.id, (0, ast.Constant(None)))[1])
            ):
                name, line = node.func.value.id, node.lineno
            if name is not None and line is not None and name in before and (name, line) not in seen:
                seen.add((name, line))
                findings.append(
                    StateFinding(
                        line,
                        f"{name!r} (bound at line {before[name][0]}, before the is_running() loop) is accumulated "
                        "inside the loop: under flare-airflow each round is a new process, so it starts from its "
                        "initial value every round",
                    )
                )
    for stmt in statements:  # loops inside functions, `if __name__ == "__main__":`, with, try
        if isinstance(stmt, ast.While) and _is_running_loop(stmt):
            continue
        for block in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, block, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                findings.extend(_check_body(inner))
        for handler in getattr(stmt, "handlers", []):
            findings.extend(_check_body(handler.body))
    return findings


def check_source(source: str, filename: str = "<script>") -> list[StateFinding]:
    """Findings in a script's source, by line; a script that does not parse has none (Python reports it)."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError:
        return []
    unique = {(f.line, f.message): f for f in _check_body(tree.body)}
    return sorted(unique.values(), key=lambda f: f.line)


def check_file(path: str | Path) -> list[StateFinding]:
    try:
        source = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return check_source(source, str(path))
