"""Name validators end at the end of the text (issue 35): Python's ``$`` also matches before a
trailing newline, so ``re.match(r"^[a-z]+$", "demo\\n")`` passes and a name with a newline reaches
a tracker, a path or a log line. The rule holds for every regular expression of the package: a
scan of its source refuses ``$`` as an anchor (use ``\\Z`` or ``fullmatch``).

Pydantic's ``Field(pattern=...)`` runs Rust's regex, where ``$`` is the end of the text: checked
by behaviour below, not by the scan.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from flare_airflow.core.config import job_from_dict
from flare_airflow.core.config.resources import ResourceManagerSpec
from flare_airflow.core.config.tracking import TrackingSpec
from flare_airflow.core.config.validators import conn_id_name, dns_label
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import safe_component
from flare_airflow.core.tracking import metric_key_problem

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "flare_airflow"
REPO = PACKAGE.parent
HERE = pathlib.Path(__file__).resolve().parent
RE_CALLS = {"compile", "match", "search", "fullmatch", "sub", "subn", "split", "findall", "finditer"}
# An unescaped '$' (not '\$'), i.e. an end anchor that also matches before a final newline.
DOLLAR_ANCHOR = re.compile(r"(?<!\\)\$")


def _pattern_text(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # rf"^{re.escape(prefix)}...": its literal parts
        return "".join(p.value for p in node.values if isinstance(p, ast.Constant) and isinstance(p.value, str))
    return None


def _dollar_patterns() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "re"
                and node.func.attr in RE_CALLS
                and node.args
            ):
                text = _pattern_text(node.args[0])
                if text is not None and DOLLAR_ANCHOR.search(text):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text!r}")
    return found


def test_no_regular_expression_of_the_package_anchors_with_dollar() -> None:
    found = _dollar_patterns()
    assert not found, "use \\Z (or fullmatch) instead of $:\n" + "\n".join(found)


def test_the_scan_finds_a_dollar_anchor(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan above can fail: it finds ``$`` in a compiled pattern and in an f-string pattern."""
    (tmp_path / "m.py").write_text('import re\nA = re.compile(r"^[a-z]+$")\nB = re.match(rf"^{x}-[0-9]+$", y)\n')
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", tmp_path)
    monkeypatch.setattr(__import__(__name__, fromlist=["REPO"]), "REPO", tmp_path)
    assert [line.split(":")[1] for line in _dollar_patterns()] == ["2", "3"]


def _job(**extra: object) -> dict[str, object]:
    return {
        "job": "demo",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": str(REPO / "examples" / "digits" / "initial_model.safetensors"),
        "trainer": {"script": pathlib.Path(__file__).name},
        "sites": {"site-1": {}},
        **extra,
    }


@pytest.mark.parametrize(
    "check",
    [
        pytest.param(lambda v: TrackingSpec.model_validate({"backend": "mlflow", "experiment": v}), id="experiment"),
        pytest.param(lambda v: TrackingSpec.model_validate({"backend": "mlflow", "register_model": v}), id="model"),
        pytest.param(lambda v: conn_id_name(v, "conn_id"), id="conn-id"),
        pytest.param(lambda v: dns_label(v, "label"), id="dns-label"),
        pytest.param(lambda v: safe_component(v, "site"), id="store-component"),
        pytest.param(lambda v: None if metric_key_problem(v) is None else 1 / 0, id="metric-key"),
        pytest.param(lambda v: job_from_dict(_job(job=v), base_dir=str(HERE)), id="job-name"),
        pytest.param(lambda v: ResourceManagerSpec.model_validate({"gpu_class": v}), id="gpu-class-pydantic-pattern"),
    ],
)
def test_a_name_with_a_trailing_newline_is_refused(check) -> None:
    check("a100")  # the same name without the newline is fine
    with pytest.raises((ValueError, FlareAirflowError, ZeroDivisionError)):
        check("a100\n")
