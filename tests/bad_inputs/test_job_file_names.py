"""Bad job files, issue 35: a name with a trailing newline (Python's ``$`` matched before it).

Each name validator of the package now ends at the end of the text (``\\Z`` / ``fullmatch``;
tests/unit/test_name_validators.py scans for the rule). Built and validated as test_job_file.py does.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.bad_inputs.cases import Case, assert_clear
from tests.bad_inputs.test_job_file import Bad, build, validate

CASES: list[Case] = []
INPUTS: dict[str, Bad] = {}


def case(id: str, bad_input: str, error: str, **bad: object) -> None:
    CASES.append(Case(id, "job_file", bad_input, error))
    INPUTS[id] = Bad(**bad)  # type: ignore[arg-type]


case(
    "job-name-trailing-newline",
    'job: "demo\\n" (a name ending in a newline)',
    "job: job name 'demo\\n' is not allowed: use lowercase letters",
    field="job",
    value="demo\n",
)
case(
    "tracking-experiment-trailing-newline",
    'tracking.experiment: "team/digits\\n"',
    "tracking.experiment must start with a letter or digit and hold only letters, digits",
    field="tracking",
    value={"backend": "mlflow", "experiment": "team/digits\n"},
)
case(
    "tracking-register-model-trailing-newline",
    'tracking.register_model: "digits\\n"',
    "tracking.register_model must start with a letter or digit and hold only letters",
    field="tracking",
    value={"backend": "mlflow", "register_model": "digits\n"},
)
case(
    "tracking-conn-id-trailing-newline",
    'tracking.conn_id: "mlflow_team\\n"',
    "tracking.conn_id",
    field="tracking",
    value={"backend": "mlflow", "conn_id": "mlflow_team\n"},
)


@pytest.mark.parametrize("bad_case", CASES, ids=lambda c: c.id)
def test_a_name_ending_in_a_newline_is_refused(bad_case: Case, tmp_path: pathlib.Path) -> None:
    assert_clear(bad_case, validate(build(tmp_path, INPUTS[bad_case.id])))
