"""Sites' reports sealed to the aggregation (issue 36 item 3): sample counts, metrics, privacy spent
and the signed record leave a site task's XCom only as ciphertext only the central box key opens.

Strict mode (a registry), through the real aggregation: sealed reports count; a report copied
into another site's XCom, or changed, is refused with its reason and the round goes on.
"""

from __future__ import annotations

import json

import pytest

from flare_airflow.core.store import ModelStore
from flare_airflow.core.trust import CENTRAL, TrustError
from flare_airflow.site_task.build import train_run
from flare_airflow.site_task.checks import seal_report
from tests.unit.airflow_layer import RUN_ID
from tests.unit.operators.test_trust_attacks import SITES, aggregate, job, keys, setup_round, task

__all__ = ["job", "keys"]  # the fixtures, shared with the records' attacks


def sealed(job, keys, site: str, summary: dict, r: int = 1, privacy: dict | None = None) -> dict:
    """What the site task's XCom holds in strict mode: its summary with the report sealed."""
    trust = {"key_dir": str(keys), "registry_path": str(keys.parent / "registry.json")}
    run = train_run(
        job, site, r, store=ModelStore.from_uri(job.store), run_id=RUN_ID, total_rounds=2, hparams={}, argv=["x"],
        try_number=1, global_sha256=None, trust=trust,
    )  # fmt: skip
    return seal_report(run, {**summary, "metrics": {"accuracy": 0.9}, "privacy": privacy or {"releases": 1}})


def test_sealed_reports_hide_counts_and_metrics_and_count_at_the_aggregation(job, keys) -> None:
    _, ti, _ = setup_round(job, keys)
    for site in SITES:
        key = (task(site, 1), "return_value")
        ti.xcoms[key] = sealed(job, keys, site, ti.xcoms[key])
        text = json.dumps(ti.xcoms[key])
        assert set(ti.xcoms[key]) == {"sha256", "report"}, "only the digest and the ciphertext are readable"
        assert "num_samples" not in text and "accuracy" not in text and "releases" not in text
    summary = aggregate(job, ti)
    assert summary["accepted"] == list(SITES) and summary["rejected"] == {}
    assert summary["num_samples"] == 30  # the counts the reports sealed, read by the aggregation only


def test_a_report_copied_to_another_site_or_changed_is_refused_and_the_round_goes_on(job, keys) -> None:
    _, ti, _ = setup_round(job, keys)
    for site in SITES:
        key = (task(site, 1), "return_value")
        ti.xcoms[key] = sealed(job, keys, site, ti.xcoms[key])
    # site-2's XCom gets site-1's genuine sealed report (and its digest); site-3's report is changed.
    ti.xcoms[(task("site-2", 1), "return_value")] = dict(ti.xcoms[(task("site-1", 1), "return_value")])
    report = ti.xcoms[(task("site-3", 1), "return_value")]["report"]
    ti.xcoms[(task("site-3", 1), "return_value")]["report"] = report[:-6] + (
        "AAAAAA" if report[-6:] != "AAAAAA" else "BBBBBB"
    )
    with pytest.raises(Exception, match="round 1 failed") as failed:
        aggregate(job, ti)  # only site-1 left: below min_clients 2
    text = str(failed.value)
    for site in ("site-2", "site-3"):
        assert f"site {site!r}'s sealed report does not open for this context" in text, site


def test_strict_mode_without_a_central_box_key_refuses_to_publish_in_clear(job, keys) -> None:
    registry = keys.parent / "registry.json"
    data = json.loads(registry.read_text())
    data["keys"] = [k for k in data["keys"] if not (k["flare_party"] == CENTRAL and k["crv"] == "X25519")]
    registry.write_text(json.dumps(data))
    with pytest.raises(TrustError, match="central keygen"):
        sealed(job, keys, "site-1", {"sha256": "0" * 64, "num_samples": 10})


def test_the_rounds_per_site_metrics_are_sealed_and_the_runs_page_opens_them(job, keys) -> None:
    from flare_airflow.core.trust.sealed import SealedOpenError, load_box_key, open_sealed, site_metrics_context
    from flare_airflow.operators.trust import open_run_xcoms
    from flare_airflow.ui.view import build_run_view

    _, ti, _ = setup_round(job, keys)
    for n, site in enumerate(SITES, 1):
        key = (task(site, 1), "return_value")
        ti.xcoms[key] = sealed(job, keys, site, ti.xcoms[key], privacy={"epsilon": 1.0 + n, "releases": 1})
    summary = aggregate(job, ti)
    # The aggregation's XCom (every site can read it) names no site's metrics in clear ...
    assert isinstance(summary["site_metrics"], str) and summary["site_metrics"].startswith("fa1.central.")
    assert "site-1" not in summary["site_metrics"] and "0.3" not in json.dumps(summary)
    # ... and a site's own box key does not open them.
    with pytest.raises(SealedOpenError, match="not to this worker's box key"):
        open_sealed(
            load_box_key(keys, "site-1"), summary["site_metrics"], context=site_metrics_context("unit", RUN_ID, 1),
            what="round 1's per-site metrics",
        )  # fmt: skip
    xcoms = {
        "prepare": {"job": job.job, "rounds": 1},
        "round_1.global_model": summary,
        **{task(s, 1): ti.xcoms[(task(s, 1), "return_value")] for s in SITES},
    }
    tis = {t: {"state": "success", "try_number": 1} for t in xcoms}
    run = {"dag_run_id": RUN_ID, "state": "success"}
    # Unopened (the page before this change): the sample and ε columns are empty.
    before = build_run_view("d", run, tis, xcoms, None)
    assert {c.num_samples for c in before.rounds[0].sites.values()} == {None}
    opened, problems = open_run_xcoms(xcoms, prefix="", run_id=RUN_ID)
    assert problems == []
    view = build_run_view("d", run, tis, opened, None)
    cells = view.rounds[0].sites
    assert {s: (c.num_samples, c.epsilon, c.releases) for s, c in cells.items()} == {
        s: (10, 1.0 + n, 1) for n, s in enumerate(SITES, 1)
    }
    # The per-site metrics the round's updates carried, opened: the page's per-site loss series.
    assert view.rows[0]["site_metrics"] == {s: {"loss": n / 10} for n, s in enumerate(SITES, 1)}


def test_publish_opens_the_sealed_per_site_metrics_into_metrics_json(job, keys) -> None:
    import collections
    import types

    from airflow.sdk import DAG

    from flare_airflow.core.store import path_from_uri
    from flare_airflow.operators.aggregate import AggregateOperator
    from flare_airflow.operators.publish import PublishOperator
    from tests.unit.airflow_layer import context

    _, ti, _ = setup_round(job, keys)
    with DAG("flare_unit", schedule=None):
        agg = AggregateOperator(
            task_id="round_1.global_model", job=job, round_num=1, site_task_ids={s: task(s, 1) for s in SITES}
        )
        publish = PublishOperator(task_id="publish", job=job, aggregate_task_ids=["round_1.global_model"])
    summary = agg.execute(context(ti))
    assert isinstance(summary["site_metrics"], str)
    ti.xcoms[("round_1.global_model", "return_value")] = summary
    ctx = context(ti, rounds=1)
    ctx["outlet_events"] = collections.defaultdict(types.SimpleNamespace)
    out = publish.execute(ctx)
    report = json.loads(path_from_uri(out["metrics"]).read_text())
    assert report["rounds"][0]["site_metrics"] == {s: {"loss": n / 10} for n, s in enumerate(SITES, 1)}
