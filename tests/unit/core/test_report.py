"""The per-round report: rows from aggregation summaries, and the plain-text table."""

from __future__ import annotations

from flare_airflow.core.report import format_table, round_row

SUMMARIES = [
    {
        "round": 1,
        "accepted": ["site-1", "site-2"],
        "rejected": {"site-3": "trainer failed: exit code 1 [EXECUTION_ERROR]"},
        "metrics": {"train_loss": 0.51234, "loss": 9.0},
        "evaluation": {"loss": 0.6, "accuracy": 0.8},
        "num_samples": 30,
        "site_metrics": {"site-1": {"train_loss": 0.4}},
        "global_uri": "file:///store/digits/run/round-0001/global.safetensors",
        "sha256": "ab" * 32,
    },
    {
        "round": 2,
        "accepted": ["site-1", "site-2", "site-3"],
        "metrics": {"loss": 0.25},
        "evaluation": {"accuracy": 0.9125, "loss": 0.4},
    },
    {"round": 10, "accepted": ["site-1"], "rejected": {"site-3": "no update", "site-2": "tensor 'w' has NaN"}},
]


def test_round_row() -> None:
    row = round_row(SUMMARIES[0], num_sites=3)
    assert row == {
        "round": 1,
        "sites_valid": 2,
        "sites_total": 3,
        "accepted": ["site-1", "site-2"],
        "rejected": {"site-3": "trainer failed: exit code 1 [EXECUTION_ERROR]"},
        "num_samples": 30,
        "train_loss": 0.51234,  # train_loss is preferred over loss
        "site_metrics": {"site-1": {"train_loss": 0.4}},
        "evaluation": {"loss": 0.6, "accuracy": 0.8},
        "global_uri": "file:///store/digits/run/round-0001/global.safetensors",
        "sha256": "ab" * 32,
        "epsilon": None,  # the job adds no noise
        "releases": None,
    }
    assert round_row(SUMMARIES[1], 3)["train_loss"] == 0.25
    empty = round_row({"round": 4}, 2)
    assert (empty["sites_valid"], empty["train_loss"], empty["rejected"]) == (0, None, {})


def test_format_table() -> None:
    table = format_table([round_row(s, num_sites=3) for s in SUMMARIES])
    assert table.splitlines() == [
        "round | valid sites | mean train loss | global accuracy | global loss",
        "------+-------------+-----------------+-----------------+------------",
        "    1 |         2/3 |          0.5123 |          0.8000 |      0.6000",
        "    2 |         3/3 |          0.2500 |          0.9125 |      0.4000",
        "   10 |         1/3 |               - |               - |           -",
        "  round 1: site-3 did not count: trainer failed: exit code 1 [EXECUTION_ERROR]",
        "  round 10: site-2 did not count: tensor 'w' has NaN",
        "  round 10: site-3 did not count: no update",
    ]


def test_format_table_without_rows_or_evaluation() -> None:
    assert format_table([]).splitlines() == [
        "round | valid sites | mean train loss",
        "------+-------------+----------------",
    ]
    table = format_table([round_row({"round": 1, "accepted": ["a"], "metrics": {"loss": 1}}, 1)])
    assert table.splitlines()[-1] == "    1 |         1/1 |               1"
    assert "global" not in table


def test_read_metrics_takes_a_path_or_a_uri_and_names_the_file_in_each_error(tmp_path) -> None:
    import json

    import pytest

    from flare_airflow.core.errors import ReportError
    from flare_airflow.core.report import read_metrics

    good = tmp_path / "metrics.json"
    good.write_text(json.dumps({"rounds": [{"round": 1, "sites_valid": 2, "sites_total": 2}]}))
    assert read_metrics(good) == read_metrics(f"file://{good}") == [{"round": 1, "sites_valid": 2, "sites_total": 2}]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rounds": [{"round": 1, "sites_valid": 2, "sites_total": 2, "evaluation": [1]}]}))
    with pytest.raises(ReportError, match=rf"{bad}: rounds\[0\].evaluation must be an object, got list"):
        read_metrics(bad)


def test_epsilon_column_when_the_job_adds_noise() -> None:
    rows = [round_row({**s, "privacy": {"epsilon": 1.993 * (i + 1)}}, 3) for i, s in enumerate(SUMMARIES[:2])]
    lines = format_table(rows).splitlines()
    assert lines[0].endswith("| global loss |      ε")
    assert lines[2].endswith("|      0.6000 | 1.9930") and lines[3].endswith("| 3.9860")
