"""Helpers every operator shares."""

from __future__ import annotations

from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.operators.common import FAILURE_XCOM_KEY, failure_to_xcom


class _Pushing:
    def __init__(self) -> None:
        self.pushed: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


class _Task:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    @failure_to_xcom
    def execute(self, context: Any) -> str:
        if self.error is not None:
            raise self.error
        return "done"


def test_a_failed_task_leaves_its_reason_in_xcom_and_still_fails() -> None:
    ti = _Pushing()
    with pytest.raises(AirflowFailException, match="round 2 not aggregated"):
        _Task(AirflowFailException("round 2 not aggregated")).execute({"ti": ti})
    assert ti.pushed == {FAILURE_XCOM_KEY: "round 2 not aggregated"}


def test_other_outcomes_leave_no_failure_reason() -> None:
    ti = _Pushing()
    assert _Task(None).execute({"ti": ti}) == "done"
    with pytest.raises(ValueError):
        _Task(ValueError("a bug")).execute({"ti": ti})
    assert ti.pushed == {}
