"""The Federated runs page's model of a run and its SVG charts (pure functions, no Airflow)."""

from __future__ import annotations

import re
from html import escape

from flare_airflow.core.report import round_row
from flare_airflow.ui import page, svg
from flare_airflow.ui.view import build_run_view, charts, task_layout

SITES = ["site-1", "site-2", "site-3"]


def _summary(r: int, rejected: dict[str, str] | None = None) -> dict:
    rejected = rejected or {}
    accepted = [s for s in SITES if s not in rejected]
    return {
        "round": r,
        "accepted": accepted,
        "rejected": rejected,
        "num_samples": 10 * len(accepted),
        "metrics": {"train_loss": 1.0 / r},
        "site_metrics": {s: {"train_loss": 1.0 / r + i} for i, s in enumerate(accepted)},
        "evaluation": {"accuracy": 0.5 + r / 10, "loss": 2.0 / r},
        "global_uri": f"file:///s/round-{r:04d}/global.safetensors",
        "sha256": "0" * 64,
    }


def _tis(rounds: int, states: dict[str, str]) -> dict[str, dict]:
    tis = {"prepare": {"state": "success", "try_number": 1}}
    for r in range(1, rounds + 1):
        for s in SITES:
            tis[f"round_{r}.{s}"] = {"state": states.get(f"round_{r}.{s}", "success"), "try_number": 1}
        tis[f"round_{r}.global_model"] = {"state": states.get(f"round_{r}.global_model", "success"), "try_number": 1}
    return tis


def _xcoms(rounds: int, rejected: dict[str, str]) -> dict:
    x: dict = {"prepare": {"rounds": rounds, "min_clients": 2, "hparams": {"lr": 0.1}, "source": "initial"}}
    for r in range(1, rounds + 1):
        x[f"round_{r}.global_model"] = _summary(r, rejected)
        for s in SITES:
            x[f"round_{r}.{s}"] = {"num_samples": 10, "metrics": {"train_loss": 0.25}, "sha256": "1" * 64}
    return x


def test_layout_from_task_ids() -> None:
    ids = ["prepare", "round_2.b", "round_1.a", "round_1.global_model", "round_10.a", "publish"]
    assert task_layout(ids) == ([1, 2, 10], ["a", "b"])


def test_a_running_run_reads_rows_from_xcom_with_core_report() -> None:
    tis = _tis(3, {"round_3.site-1": "running", "round_3.global_model": "none"})
    xcoms = _xcoms(2, {})
    view = build_run_view("d", {"dag_run_id": "r1", "state": "running", "conf": {"rounds": 3}}, tis, xcoms, None)
    assert view.rows_from == "xcom" and not view.finished
    assert view.rows == [round_row(_summary(1), 3), round_row(_summary(2), 3)]
    assert view.rounds[2].sites["site-1"].state == "running" and view.rounds[2].valid is None
    assert view.min_clients == 2 and view.params["hparams"] == {"lr": 0.1}


def test_a_site_whose_update_was_rejected_is_not_counted_and_a_failed_one_failed() -> None:
    rejected = {"site-2": "update has NaN", "site-3": "trainer failed: exit code 3"}
    tis = _tis(1, {"round_1.site-3": "failed"})
    view = build_run_view("d", {"dag_run_id": "r", "state": "failed"}, tis, _xcoms(1, rejected), None)
    cells = view.rounds[0].sites
    assert (cells["site-1"].state, cells["site-2"].state, cells["site-3"].state) == ("success", "not counted", "failed")
    assert cells["site-2"].reason == "update has NaN" and cells["site-3"].reason == rejected["site-3"]
    assert cells["site-1"].num_samples == 10 and cells["site-1"].train_loss == 0.25
    assert view.rounds[0].valid == 1


def test_published_metrics_json_wins_and_charts_have_one_point_per_round() -> None:
    metrics = {"rounds": [round_row(_summary(r), 3) for r in (1, 2)]}
    metrics["rounds"][1]["evaluation"]["accuracy"] = 0.123456789
    view = build_run_view("d", {"dag_run_id": "r", "state": "success"}, _tis(2, {}), _xcoms(2, {}), metrics)
    assert view.rows_from == "metrics.json"
    found = {c.key: c for c in charts(view)}
    assert found["accuracy"].series[0].points == [(1, 0.6), (2, 0.123456789)]
    assert [s.name for s in found["site_loss"].series] == SITES
    assert found["valid"].reference == ("min_clients", 2.0)
    html = svg.render(found["accuracy"])
    values = re.findall(r'<circle class="point"[^>]*data-round="(\d+)" data-value="([^"]+)"', html)
    assert values == [("1", "0.6"), ("2", "0.123456789")]


def test_an_empty_chart_says_so_and_names_are_escaped() -> None:
    view = build_run_view("d<x>", {"dag_run_id": "r&1", "state": "queued"}, _tis(1, {}), {}, None)
    assert all("no aggregated round" in svg.render(c) for c in charts(view))
    html = page.run_page(view, "", [])
    assert "d<x>" not in html and "d&lt;x&gt;" in html
    assert 'data-refresh-ms="5000"' in html and "/flare/static/page.js" in html  # a running run refreshes itself
    assert "<script>" not in html and "style=" not in html  # nothing inline: the CSP forbids it
    assert 'data-airflow href="/dags/d%3Cx%3E/runs/r%261/tasks/round_1.site-1?try_number=1"' in html


def test_run_failures_are_shown_whole_with_their_tries_and_dot_ids_stay_in_place() -> None:
    """Issue 28 #8: a run failing in prepare shows why (not only upstream_failed cells), whole."""
    tis = _tis(1, {"round_1.global_model": "upstream_failed"})
    tis["prepare"] = {"state": "failed", "try_number": 3}
    tis["publish"] = {"state": "upstream_failed", "try_number": 1}
    tis["verdict"] = {"state": "failed", "try_number": 1}
    for t in ("round_1.site-1", "round_1.site-2", "round_1.site-3"):
        tis[t]["state"] = "upstream_failed"
    why = "invalid run parameters: unknown run parameter(s) 'hp_lrr' (did you mean 'hp_lr'?); allowed: " + "x" * 300
    view = build_run_view("..", {"dag_run_id": ".", "state": "failed"}, tis, {}, None, {"prepare": why})
    assert [(f.task_id, f.state, f.try_number) for f in view.failures] == [
        ("prepare", "failed", 3),
        ("publish", "upstream_failed", 1),
        ("verdict", "failed", 1),
    ]
    html = page.run_page(view, "/base", [])
    assert escape(why) in html and "try 3" in html  # whole, and the retries
    # The verdict left none here: with the run id ".", the page says why no task of it can.
    assert "no reason recorded: see the log" not in html and "cannot serve a run with the id" in html
    # Ids "." and "..": the page's own links carry them in the query, where a browser keeps them.
    assert 'href="/base/flare/dag?dag_id=..">' in html


def test_links_and_segments() -> None:
    from flare_airflow.core.page_paths import run_page_path, segment

    assert segment("..") == "%2E%2E" and segment("a/b?c#d") == "a%2Fb%3Fc%23d"
    assert run_page_path("d.1", "manual__2026+00:00") == "/flare/run?dag_id=d.1&run_id=manual__2026%2B00%3A00"


def test_the_plugin_module_stays_light_for_task_processes() -> None:
    # Airflow loads every plugin in every task process (macros): the page's app, FastAPI and
    # Airflow's API security must not come with it; the api-server imports them on first use.
    import subprocess
    import sys

    code = (
        "import sys, flare_airflow.ui.plugin as p; "
        "print([m for m in ('flare_airflow.ui.api', 'airflow.api_fastapi.core_api.security') if m in sys.modules]); "
        "print(p.FlareAirflowPlugin.fastapi_apps[0]['url_prefix'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "/flare"]


def test_a_federated_task_group_in_a_dag_of_your_own() -> None:
    tis = {f"digits.{t}": ti for t, ti in _tis(2, {"round_2.global_model": "failed"}).items()}
    tis["train_more"] = {"state": "success", "try_number": 1}
    xcoms = {f"digits.{t}": v for t, v in _xcoms(1, {}).items()}
    failures = {"digits.round_2.global_model": "round 2 failed: 1 valid update, min_clients is 2"}
    view = build_run_view("mine", {"dag_run_id": "r", "state": "failed"}, tis, xcoms, None, failures)
    assert view.sites == SITES and [r.round for r in view.rounds] == [1, 2]
    assert view.rounds[0].sites["site-1"].task_id == "digits.round_1.site-1"
    assert view.min_clients == 2 and len(view.rows) == 1
    assert (
        view.rounds[1].aggregate_state == "failed" and view.rounds[1].reason == failures["digits.round_2.global_model"]
    )
    assert failures["digits.round_2.global_model"] in page.run_page(view, "", [])


def test_a_failed_site_shows_the_reason_its_task_left_when_no_round_summary_names_it() -> None:
    tis = _tis(1, {"round_1.site-2": "failed", "round_1.global_model": "failed"})
    xcoms = {"prepare": _xcoms(1, {})["prepare"]}
    view = build_run_view("d", {"dag_run_id": "r", "state": "failed"}, tis, xcoms, None, {"round_1.site-2": "OOM"})
    assert view.rounds[0].sites["site-2"].state == "failed" and view.rounds[0].sites["site-2"].reason == "OOM"


def test_the_privacy_spent_after_each_round_and_the_budget_show_on_the_page() -> None:
    xcoms = _xcoms(2, {})
    for r, eps in ((1, 1.993), (2, 2.918)):
        xcoms[f"round_{r}.global_model"]["privacy"] = {"epsilon": eps, "delta": 1e-5, "noise_multiplier": 2.0}
    xcoms["prepare"]["budget_note"] = "privacy budget exhausted at round 3: its ε would be 3.6"
    view = build_run_view("d", {"dag_run_id": "r1", "state": "success", "conf": {}}, _tis(2, {}), xcoms, None)
    assert [rnd.epsilon for rnd in view.rounds] == [1.993, 2.918]
    assert [row["epsilon"] for row in view.rows] == [1.993, 2.918]
    html = page.run_content(view, "/ui", [])
    assert '<small class="epsilon" data-value="2.918">ε 2.918</small>' in html
    assert "privacy budget exhausted at round 3" in html


def test_the_strategy_and_each_sites_own_epsilon_and_releases_show() -> None:
    """Issue 37 #2: the aggregation column named FedAvg whatever the strategy, and with a gaussian
    filter in the sites' own policy (no job-level noise) no ε was shown, though every site reported it."""
    xcoms = _xcoms(2, {})
    for r in (1, 2):
        xcoms[f"round_{r}.global_model"].update(strategy="fedadam", strategy_params={"eta": 0.05, "tau": 0.001})
        for i, s in enumerate(SITES):
            account = {"epsilon": 1.5 * r + i, "delta": 1e-5, "noise_multiplier": 1.1, "filters": ["gaussian"]}
            xcoms[f"round_{r}.{s}"]["privacy"] = {**account, **({"releases": r} if s == "site-1" else {})}
    view = build_run_view("d", {"dag_run_id": "r1", "state": "success", "conf": {}}, _tis(2, {}), xcoms, None)
    html = page.run_content(view, "/ui", [])
    assert '<th class="strategy">global model (fedadam)</th>' in html and "FedAvg" not in html
    assert "<th>strategy</th><td>fedadam eta=0.05 tau=0.001</td>" in html
    site_3 = re.search(r'<td class="cell" data-round="2" data-site="site-3".*?</td>', html)
    assert site_3 and '<small class="epsilon" data-value="5.0">ε 5.000</small>' in site_3.group(0)
    site_1 = re.search(r'<td class="cell" data-round="2" data-site="site-1".*?</td>', html)
    assert site_1 and '<small class="releases">releases 2</small>' in site_1.group(0)
    aggregate = re.search(r'<td class="cell aggregate" data-round="2".*?</td>', html)
    assert aggregate and "ε ≤ 5.000 (sites)" in aggregate.group(0)


def test_the_run_links_to_its_mlflow_run_and_only_through_http() -> None:
    run = {"dag_run_id": "r1", "state": "success", "conf": {}}
    link = {"experiment_id": "3", "run_id": "abc", "url": "http://mlflow.internal:5000/#/experiments/3/runs/abc"}
    xcoms = _xcoms(1, {})
    assert build_run_view("d", run, _tis(1, {}), xcoms, None).mlflow_run is None  # tracking off: nothing shown
    xcoms["prepare"]["mlflow_run"] = link
    view = build_run_view("d", run, _tis(1, {}), xcoms, None)
    assert view.mlflow_run == link
    html = page.run_content(view, "", [])
    assert f'<a class="mlflow" data-top href="{escape(link["url"])}">run abc (experiment 3)</a>' in html
    # An XCom is any task's to write: a script URL is not a link, the ids stay text.
    xcoms["publish"] = {"mlflow_run": {**link, "url": "javascript:alert(1)"}}
    tis = {**_tis(1, {}), "publish": {"state": "success", "try_number": 1}}
    view = build_run_view("d", run, tis, xcoms, None)
    assert view.mlflow_run == {**link, "url": None}
    html = page.run_content(view, "", [])
    assert "javascript:" not in html and "MLflow: run abc (experiment 3)" in html


def test_the_mlflow_link_resolves_when_the_page_renders() -> None:
    """Issue 37 #4: a run tracked on its own server links there, whatever mlflow_ui_url says; a run
    of the embedded store follows mlflow_ui_url as set now (stored links were frozen at run time)."""
    run = {"dag_run_id": "r1", "state": "success", "conf": {}}
    xcoms = _xcoms(1, {})

    def url(link: dict, mlflow_ui: str | None) -> str | None:
        xcoms["prepare"]["mlflow_run"] = link
        found = build_run_view("d", run, _tis(1, {}), xcoms, None, mlflow_ui=mlflow_ui).mlflow_run
        return found["url"] if found else "no link"

    on_server = {"experiment_id": "3", "run_id": "abc", "server": "http://team:5000", "url": "http://team:5000/x"}
    assert url(on_server, "http://ui.now") == "http://team:5000/#/experiments/3/runs/abc"
    embedded = {"experiment_id": "3", "run_id": "abc", "server": None, "url": None}
    assert url(embedded, None) is None
    assert url(embedded, "http://ui.now/") == "http://ui.now/#/experiments/3/runs/abc"  # set after the run
    older = {"experiment_id": "3", "run_id": "abc", "url": "http://ui.then/#/experiments/3/runs/abc"}
    assert url(older, "http://ui.now") == "http://ui.now/#/experiments/3/runs/abc"
    assert url(older, None) == "http://ui.then/#/experiments/3/runs/abc"
    assert url({**on_server, "server": "javascript:alert(1)//"}, None) is None


def test_tasks_that_never_ran_have_no_log_and_a_run_without_rounds_has_no_empty_charts() -> None:
    """Issue 37 #7: a "log" link to an empty log; "no reason recorded: see the log" for a publish
    that never ran; four empty charts for a run that never aggregated."""
    tis = _tis(1, {"round_1.site-1": "failed", "round_1.global_model": "failed"})
    tis["round_1.global_model"]["try_number"] = 1
    tis["round_1.site-2"] = {"state": "upstream_failed", "try_number": 0}
    tis["publish"] = {"state": "upstream_failed", "try_number": 0}
    xcoms = _xcoms(1, {})
    del xcoms["round_1.global_model"]
    view = build_run_view("d", {"dag_run_id": "r1", "state": "failed", "conf": {}}, tis, xcoms, None)
    html = page.run_content(view, "", [])
    site_2 = re.search(r'<td class="cell" data-round="1" data-site="site-2".*?</td>', html)
    assert site_2 and "log" not in site_2.group(0)
    site_1 = re.search(r'<td class="cell" data-round="1" data-site="site-1".*?</td>', html)
    assert site_1 and 'class="log"' in site_1.group(0)
    publish = re.search(r'<tr data-task="publish".*?</tr>', html)
    assert publish and "not run: a task it waits for failed (round_1.global_model)" in publish.group(0)
    assert 'class="log"' not in publish.group(0)
    assert "<svg" not in html and "No round has been aggregated in this run" in html


def test_a_failed_publish_does_not_promise_a_publication() -> None:
    """Issue 37 #7: after a publish re-run failed, the page said "Published when the run succeeds"
    while final/ and the Asset event of the earlier try remained."""
    tis = {**_tis(1, {}), "publish": {"state": "failed", "try_number": 2}}
    view = build_run_view("d", {"dag_run_id": "r1", "state": "failed", "conf": {}}, tis, _xcoms(1, {}), None)
    html = page.run_content(view, "", [])
    assert "Published when the run succeeds" not in html
    assert "Not published: the latest try of <code>publish</code> failed" in html


def test_a_run_id_dot_says_why_prepare_left_no_reason() -> None:
    tis = {**_tis(1, {}), "prepare": {"state": "failed", "try_number": 1}}
    view = build_run_view("d", {"dag_run_id": ".", "state": "failed", "conf": {}}, tis, {}, None)
    html = page.run_content(view, "", [])
    assert "cannot serve a run with the id &#x27;.&#x27;" in html and "no reason recorded" not in html


def test_a_data_driven_run_shows_what_each_site_trained_on_and_why_one_sat_out() -> None:
    """Issue 39: the run page's site data, and the reason in the skipped site's cells."""
    xcoms = _xcoms(1, {"site-3": "sat this run out: no data announced since its last run"})
    why = "no data announced since its last run"
    xcoms["prepare"].update(
        participants=["site-1", "site-2"],
        sat_out={"site-3": why},
        data={
            "site-1": {"version": "v7", "samples": 120, "announced_at": "2026-12-06T07:00:00+00:00"},
            "site-2": {"version": "2026-12", "samples": 80, "announced_at": "2026-12-06T07:10:00+00:00"},
            "site-3": {"version": None, "samples": None, "announced_at": None, "reason": why},
        },
    )
    tis = _tis(1, {"round_1.site-3": "skipped"})
    view = build_run_view("d", {"dag_run_id": "r", "state": "success"}, tis, xcoms, None)
    assert view.rounds[0].sites["site-3"].reason == "sat this run out: no data announced since its last run"
    assert view.site_data["site-1"]["version"] == "v7" and view.site_data["site-3"]["reason"] == why
    html = page.run_content(view, "", [])
    table = html.split('<table class="site-data">')[1].split("</table>")[0]
    assert '<tr data-site="site-1"><th>site-1</th><td>v7</td><td class="num">120</td>' in table
    assert "trained on it" in table and escape(why) in table


def test_the_job_page_lists_each_sites_latest_announcement_and_the_run_that_consumed_it() -> None:
    from flare_airflow.ui.view import latest_announcements

    def event(site: str, version: str, when: str, runs: list[dict]) -> dict:
        return {"partition_key": site, "timestamp": when, "created_dagruns": runs,
                "extra": {"version": version, "samples": 5, "announced_at": when}}  # fmt: skip

    events = [
        event("site-1", "v1", "2026-12-06T07:00:00", [{"dag_id": "d", "run_id": "run-1"}]),
        event("site-1", "v2", "2026-12-06T08:00:00", []),
        event(
            "site-2",
            "v1",
            "2026-12-06T07:01:00",
            [{"dag_id": "other", "run_id": "x"}, {"dag_id": "d", "run_id": "run-1"}],
        ),
    ]
    latest = latest_announcements(events, "d")
    assert latest["site-1"] == {"version": "v2", "samples": 5, "announced_at": "2026-12-06T08:00:00", "run_id": None}
    assert latest["site-2"]["run_id"] == "run-1"
    why = "Federated job j: 1 rounds of FedAvg over 4 sites, quorum 2; runs when 3 of its 4 sites announced fresh data"
    html = page.dag_page("", "d", [], latest, why)
    assert "not consumed yet: waits for the quorum of the next run" in html
    assert f"1 site(s) announced data no run has used yet: site-1. No run yet: {why}." in html
    assert '<a href="/flare/dags/d/runs/run-1">run-1</a>' in html or ">run-1</a>" in html


def test_a_run_the_data_watch_started_is_named_as_the_consumer_of_what_it_trained_on() -> None:
    """Such a run consumed no asset event in Airflow's records: its prepare's data says what it used."""
    from flare_airflow.ui.view import mark_used_by

    latest = {
        "site-1": {"version": "v2", "announced_at": "2026-12-06T08:00:00+00:00", "run_id": None},
        "site-2": {"version": "v1", "announced_at": "2026-12-06T07:00:00+00:00", "run_id": None},
        "site-3": {"version": "v5", "announced_at": "2026-12-06T07:30:00+00:00", "run_id": None},
    }
    prepared = {
        "data": {
            "site-1": {"version": "v1", "announced_at": "2026-12-06T06:00:00+00:00"},  # an older one: not the latest
            "site-2": {"version": "v1", "announced_at": "2026-12-06T07:00:00+00:00", "samples": 3},
            "site-3": {"version": "v5", "announced_at": "2026-12-06T07:30:00+00:00", "reason": "used by run r0"},
        }
    }
    mark_used_by(latest, prepared, "manual__watch")
    assert {s: a["run_id"] for s, a in latest.items()} == {"site-1": None, "site-2": "manual__watch", "site-3": None}
