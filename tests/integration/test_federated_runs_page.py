"""The Federated runs page in real Airflow (api-server, scheduler, dag-processor, triggerer on
SQLite, started by `make airflow`'s launcher) and a real browser (Debian's headless Chromium,
driven by Playwright; no browser download).

One Airflow for the module: the demo DAG (digits, 2 of its 5 rounds) and a job whose site-4 fails
every round run side by side (the latter tracked in MLflow's embedded store: its page links to its
MLflow run); the page is opened while the demo run is still running and must update itself to the
final numbers. Screenshots are saved in the module's tmp dir (path printed).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import yaml
from mlflow.tracking import MlflowClient
from playwright.sync_api import Browser, Page, sync_playwright

from flare_airflow.core.privacy.accountant import epsilon_after
from flare_airflow.core.tracking import run_key
from flare_airflow_testing.harness import behave_job
from flare_airflow_testing.local_airflow import REPO, Api, LocalAirflow, process_tree, started

CHROMIUM = "/usr/bin/chromium"
PASSWORDS = {"admin": "admin-pw-for-test", "outsider": "outsider-pw-for-test"}
DEMO, ONE_DOWN, NO_QUORUM, TYPED = "flare_digits", "flare_one_down", "flare_no_quorum", "flare_typed"
SITE_NOISE = {"filters": [{"type": "gaussian", "clip": 1.0, "noise_multiplier": 1.1}], "delta": 1.0e-5}
# Two rounds are what the page test needs (a round of points to add while the page watches, rounds
# that ran next to rounds that did not); each more round is four more site tasks and an aggregation
# for the suite's two cores.
DEMO_ROUNDS = 2
MLFLOW_UI = "http://127.0.0.1:5999"  # [flare_airflow] mlflow_ui_url: where this deployment serves `mlflow ui`


class Stack:
    def __init__(self, airflow: LocalAirflow, root: pathlib.Path) -> None:
        self.airflow, self.root, self.base = airflow, root, airflow.base
        self.admin = airflow.token("admin", PASSWORDS["admin"])
        self.outsider = airflow.token("outsider", PASSWORDS["outsider"])
        self.api = Api(self.base, self.admin)
        self.runs: dict[str, str] = {}

    def run_url(self, dag_id: str) -> str:
        return f"{self.base}/flare/dags/{dag_id}/runs/{quote(self.runs[dag_id], safe='')}"

    def store_run_dir(self, dag_id: str) -> pathlib.Path:
        run = quote(self.runs[dag_id], safe="")
        published = self.api("GET", f"/dags/{dag_id}/dagRuns/{run}/taskInstances/publish/xcomEntries/return_value")
        published = published["value"]
        return pathlib.Path(published["metrics"].removeprefix("file://")).parent


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("ui")
    dags = root / "dags"
    dags.mkdir()
    (dags / "digits_dag.py").write_text(
        f"from flare_airflow.builder import build_dag\ndag = build_dag({str(REPO / 'dags' / 'digits.yaml')!r})\n"
    )
    job = behave_job(root, "one-down", sites=4, rounds=2, min_clients=3, args=["--fail", "site-4"])
    job["tracking"] = {"backend": "mlflow"}
    lost = behave_job(root, "no-quorum", sites=2, rounds=1, min_clients=2, args=["--fail", "site-2"])
    # A float hyper-parameter typed into Airflow's own trigger dialog (issue 37): one site, one round.
    typed = behave_job(root, "typed", sites=1, rounds=1, min_clients=1, args=["--echo-args", "echo.json"])
    typed["evaluate"] = False
    typed["trainer"]["hparams"] = {"lr": 0.01, "local_epochs": 5}
    typed["trainer"]["hparam_ranges"] = {"lr": {"min": 0, "max": 1}, "local_epochs": {"min": 1, "max": 50}}
    # ... aggregated by FedAdam, with a gaussian filter in the site's own privacy block (issue 37 #2).
    typed["aggregator"] = {"name": "fedadam", "eta": 0.05}
    typed["sites"]["site-1"] = {"privacy": {**SITE_NOISE, "public_metrics": ["train_loss"]}}
    for name, spec in (("one_down", job), ("no_quorum", lost), ("typed", typed)):
        (dags / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        (dags / f"{name}_dag.py").write_text(
            "from pathlib import Path\nfrom flare_airflow.builder import build_dag\n"
            f"dag = build_dag(Path(__file__).with_name('{name}.yaml'))\n"
        )
    # The test-only auth manager is importable from a directory of its own: the repository root
    # on PYTHONPATH would also expose its flare_airflow.egg-info, a second copy of the plugin's
    # entry point (Airflow then reports "already registered" as a plugin import error).
    auth = root / "auth_manager"
    auth.mkdir()
    shutil.copy(pathlib.Path(__file__).with_name("dag_denying_auth_manager.py"), auth)
    passwords = root / "passwords.json"
    passwords.write_text(json.dumps(PASSWORDS))
    airflow = LocalAirflow(
        root,
        dags,
        env={
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,outsider:viewer",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            # A test-only SimpleAuthManager subclass: the outsider may not read the demo DAG
            # (SimpleAuthManager alone has no per-DAG permissions; see its docstring).
            "AIRFLOW__CORE__AUTH_MANAGER": "dag_denying_auth_manager.DagDenyingAuthManager",
            "FLARE_TEST_DENIED_DAGS": f"outsider:{DEMO}",
            "PYTHONPATH": str(auth),
            "AIRFLOW__FLARE_AIRFLOW__MLFLOW_UI_URL": MLFLOW_UI,
            # the sites' noise secret, as a site's worker holds it (128 bits or more: weaker ones are refused)
            "AIRFLOW_VAR_FLARE_NOISE_SECRET": secrets.token_hex(32),
        },
    )
    airflow.start()
    try:
        s = Stack(airflow, root)
        s.runs[DEMO] = s.api.trigger(DEMO, {"rounds": DEMO_ROUNDS})
        s.runs[ONE_DOWN] = s.api.trigger(ONE_DOWN, {"rounds": 2})
        s.runs[NO_QUORUM] = s.api.trigger(NO_QUORUM, {})
        yield s
    finally:
        print(airflow.stop())


@pytest.fixture(scope="module")
def browser(stack: Stack) -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
        )
        # The Playwright driver and the browser are this process's descendants.
        ours = {
            pid: when
            for pid, when in process_tree(os.getpid()).items()
            if b"chromium" in _cmdline(pid) or b"playwright" in _cmdline(pid)
        }
        assert any(b"chromium" in _cmdline(pid) for pid in ours), "no chromium process found"
        try:
            yield b
        finally:
            b.close()
    deadline = time.monotonic() + 10
    while (left := [pid for pid, when in ours.items() if started(pid) == when]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"browser processes left: {left}"


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _page(browser: Browser, stack: Stack, token: str) -> Page:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    # Airflow's UI keeps the user's token in this cookie; the plugin's page (in an iframe of the
    # UI, same origin) is authenticated by it like every API call of the UI.
    context.add_cookies([{"name": "_token", "value": token, "url": stack.base}])
    return context.new_page()


def _shot(page: Page, stack: Stack, name: str) -> None:
    path = stack.root / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def _points(page: Page, chart: str) -> dict[str, list[tuple[int, float]]]:
    found: dict[str, list[tuple[int, float]]] = {}
    for el in page.locator(f'svg[data-chart="{chart}"] circle.point').all():
        series = el.get_attribute("data-series") or ""
        found.setdefault(series, []).append(
            (int(el.get_attribute("data-round") or 0), float(el.get_attribute("data-value") or "nan"))
        )
    return found


def _metrics(stack: Stack, dag_id: str) -> dict[str, Any]:
    return json.loads((stack.store_run_dir(dag_id) / "metrics.json").read_text())


def test_demo_run_page_updates_while_running_and_matches_metrics_json(stack: Stack, browser: Browser) -> None:
    page = _page(browser, stack, stack.admin)
    page.goto(stack.run_url(DEMO))
    assert page.locator('[data-finished="false"]').count() == 1  # opened while the run goes on
    _shot(page, stack, "demo-running")
    # No reload: the page refreshes its content itself until the run has finished.
    page.wait_for_selector('[data-finished="true"]', timeout=240_000)
    assert stack.api.wait(DEMO, stack.runs[DEMO]) == "success"
    page.reload()  # the refreshed content and a fresh render must agree; assert on the fresh one
    _shot(page, stack, "demo-finished")
    states = stack.api.task_states(DEMO, stack.runs[DEMO])
    sites = ["site-1", "site-2", "site-3", "site-4"]
    for r in range(1, 6):
        row = page.locator(f'table.rounds tr[data-round="{r}"]')
        assert row.count() == 1, r
        for site in sites:
            cell = row.locator(f'td[data-site="{site}"]')
            expected = states[f"round_{r}.{site}"]
            assert cell.get_attribute("data-state") == expected == ("success" if r <= DEMO_ROUNDS else "skipped")
            if r <= DEMO_ROUNDS:
                log = cell.locator("a.log").get_attribute("href")
                run = quote(stack.runs[DEMO], safe="")
                assert log == f"/dags/{DEMO}/runs/{run}/tasks/round_{r}.{site}?try_number=1"
                assert "samples" in cell.inner_text() and "train loss" in cell.inner_text()
            else:  # issue 37 #7: a task that never ran has no log to open
                assert cell.locator("a.log").count() == 0
        aggregate = row.locator("td.aggregate")
        assert aggregate.get_attribute("data-state") == ("success" if r <= DEMO_ROUNDS else "skipped")
    rows = _metrics(stack, DEMO)["rounds"]
    assert [row["round"] for row in rows] == list(range(1, DEMO_ROUNDS + 1))

    def per_round(value: Any) -> list[tuple[int, float]]:
        return [(row["round"], float(value(row))) for row in rows]

    assert _points(page, "accuracy") == {"global accuracy": per_round(lambda row: row["evaluation"]["accuracy"])}
    assert _points(page, "loss") == {
        "global loss": per_round(lambda row: row["evaluation"]["loss"]),
        "mean train loss": per_round(lambda row: row["train_loss"]),
    }
    assert _points(page, "site_loss") == {
        site: per_round(lambda row, s=site: row["site_metrics"][s]["train_loss"]) for site in sites
    }
    assert _points(page, "valid") == {"valid updates": per_round(lambda row: row["sites_valid"])}
    quorum = page.locator('svg[data-chart="valid"] line.reference')
    assert (
        quorum.get_attribute("data-reference") == "min_clients" and float(quorum.get_attribute("data-value") or 0) == 3
    )
    params = page.locator("h2:text('Parameters') + table").inner_text()
    assert json.dumps({"rounds": DEMO_ROUNDS}) in params and "lr" in params
    # Each download link names the sha256 the page shows.
    files = {
        el.get_attribute("data-file"): el.locator("td.sha").inner_text() for el in page.locator("tr[data-file]").all()
    }
    assert set(files) == {"model", "metrics", "plot"}
    assert files["model"] == _metrics(stack, DEMO)["sha256"]


def test_page_in_airflow_ui_nav_and_admin_plugins(stack: Stack, browser: Browser) -> None:
    page = _page(browser, stack, stack.admin)
    page.goto(f"{stack.base}/plugin/federated-runs")
    frame = page.frame_locator("iframe")
    frame.locator(f'tr[data-dag="{DEMO}"]').wait_for(timeout=60_000)
    assert frame.locator(f'tr[data-dag="{ONE_DOWN}"]').count() == 1
    _shot(page, stack, "airflow-nav")
    page.goto(f"{stack.base}/plugins")  # Admin -> Plugins
    page.get_by_text("flare_airflow").first.wait_for(timeout=60_000)
    _shot(page, stack, "admin-plugins")
    plugins = stack.api("GET", "/plugins")["plugins"]
    (ours,) = [p for p in plugins if p["name"] == "flare_airflow"]
    # Loaded without error (an error shows as a red badge on Admin -> Plugins).
    errors = stack.api("GET", "/plugins/importErrors")
    assert not [e for e in errors["import_errors"] if "flare" in json.dumps(e)], errors
    assert ours["fastapi_apps"][0]["url_prefix"] == "/flare"
    assert ours["external_views"][0]["url_route"] == "federated-runs"


def test_failing_site_fails_every_round_and_the_round_still_counts(stack: Stack, browser: Browser) -> None:
    assert stack.api.wait(ONE_DOWN, stack.runs[ONE_DOWN]) == "success"
    page = _page(browser, stack, stack.admin)
    page.goto(stack.run_url(ONE_DOWN))
    page.wait_for_selector('[data-finished="true"]')
    _shot(page, stack, "one-site-down")
    for r in (1, 2):
        row = page.locator(f'table.rounds tr[data-round="{r}"]')
        assert row.locator('td[data-site="site-4"]').get_attribute("data-state") == "failed"
        assert "exit code 3" in row.locator('td[data-site="site-4"]').inner_text()
        for i in (1, 2, 3):
            assert row.locator(f'td[data-site="site-{i}"]').get_attribute("data-state") == "success"
        aggregate = row.locator("td.aggregate")
        assert aggregate.get_attribute("data-state") == "success" and "3/4 valid" in aggregate.inner_text()
    assert _points(page, "valid") == {"valid updates": [(1, 3.0), (2, 3.0)]}
    assert [row["sites_valid"] for row in _metrics(stack, ONE_DOWN)["rounds"]] == [3, 3]
    # The run links to its run in MLflow's UI: the one the tracker holds for this DAG run.
    (db,) = stack.root.rglob("mlflow.db")
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("one-down")
    key = run_key(ONE_DOWN, stack.runs[ONE_DOWN])
    (tracked,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`flare_airflow.run_key` = '{key}'")
    href = page.locator("a.mlflow").get_attribute("href")
    assert href == f"{MLFLOW_UI}/#/experiments/{experiment.experiment_id}/runs/{tracked.info.run_id}"


def test_a_round_without_quorum_shows_why(stack: Stack, browser: Browser) -> None:
    assert stack.api.wait(NO_QUORUM, stack.runs[NO_QUORUM]) == "failed"
    page = _page(browser, stack, stack.admin)
    page.goto(stack.run_url(NO_QUORUM))
    _shot(page, stack, "no-quorum")
    row = page.locator('table.rounds tr[data-round="1"]')
    aggregate = row.locator("td.aggregate")
    assert aggregate.get_attribute("data-state") == "failed"
    assert "round 1 failed" in aggregate.inner_text()  # the reason the aggregation task left
    site = row.locator('td[data-site="site-2"]')
    assert site.get_attribute("data-state") == "failed" and "exit code 3" in site.inner_text()
    assert page.locator('svg[data-chart="valid"] circle.point').count() == 0  # no round was aggregated
    assert page.locator("p.no-charts").count() == 1  # a sentence, not four empty charts
    assert page.locator("tr[data-file]").count() == 0  # nothing published


def test_endpoints_need_a_token_and_dag_access(stack: Stack) -> None:
    assert stack.api.wait(DEMO, stack.runs[DEMO]) == "success"
    demo = quote(stack.runs[DEMO], safe="")
    other = quote(stack.runs[ONE_DOWN], safe="")
    urls = [
        f"/flare/dags/{DEMO}",
        f"/flare/dags/{DEMO}/runs/{demo}",
        f"/flare/api/dags/{DEMO}/runs/{demo}",
        f"/flare/api/dags/{DEMO}/runs/{demo}/files/model",
    ]
    for url in ["/flare/", *urls]:
        assert httpx.get(stack.base + url, timeout=30).status_code == 401, url
    outsider = {"Authorization": f"Bearer {stack.outsider}"}
    for url in urls:
        r = httpx.get(stack.base + url, headers=outsider, timeout=30)
        assert r.status_code == 403, (url, r.status_code, r.text[:300])
    # The same user reads the DAG it may read: the denial is per DAG, decided by the auth manager.
    r = httpx.get(f"{stack.base}/flare/api/dags/{ONE_DOWN}/runs/{other}", headers=outsider, timeout=30)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["mlflow_run"]["url"].startswith(MLFLOW_UI)  # the MLflow link is the run's, behind the same checks
    anonymous = httpx.get(f"{stack.base}/flare/api/dags/{ONE_DOWN}/runs/{other}", timeout=30)
    assert anonymous.status_code == 401 and "mlflow" not in anonymous.text
    index = httpx.get(f"{stack.base}/flare/", headers=outsider, timeout=30).text
    assert ONE_DOWN in index and DEMO not in index


def test_downloads_stream_the_published_bytes(stack: Stack) -> None:
    assert stack.api.wait(DEMO, stack.runs[DEMO]) == "success"
    admin = {"Authorization": f"Bearer {stack.admin}"}
    run = quote(stack.runs[DEMO], safe="")
    final = stack.store_run_dir(DEMO)
    record = json.loads((final / "model.json").read_text())
    with httpx.stream("GET", f"{stack.base}/flare/api/dags/{DEMO}/runs/{run}/files/model", headers=admin) as r:
        assert r.status_code == 200
        digest = hashlib.sha256()
        for piece in r.iter_bytes():
            digest.update(piece)
    assert digest.hexdigest() == record["sha256"] == r.headers["x-flare-sha256"]
    for name, file in (("metrics", "metrics.json"), ("plot", "metrics.png")):
        body = httpx.get(f"{stack.base}/flare/api/dags/{DEMO}/runs/{run}/files/{name}", headers=admin).content
        assert body == (final / file).read_bytes()
    data = httpx.get(f"{stack.base}/flare/api/dags/{DEMO}/runs/{run}", headers=admin).json()
    shas = {d["name"]: d["sha256"] for d in data["downloads"]}
    assert shas["model"] == record["sha256"]
    assert shas["metrics"] == hashlib.sha256((final / "metrics.json").read_bytes()).hexdigest()
    assert httpx.get(f"{stack.base}/flare/api/dags/{DEMO}/runs/{run}/files/secrets", headers=admin).status_code == 404


def test_links_work_inside_airflows_sandboxed_iframe(stack: Stack, browser: Browser) -> None:
    """Issue 28 #8: Browse -> Federated runs shows the page in an iframe sandboxed without
    allow-top-navigation and allow-popups; its links into Airflow must still navigate."""
    assert stack.api.wait(ONE_DOWN, stack.runs[ONE_DOWN]) == "success"
    page = _page(browser, stack, stack.admin)
    page.goto(f"{stack.base}/")
    page.get_by_role("button", name="Browse").click()
    page.get_by_role("menuitem", name="Federated runs").click()
    page.wait_for_url("**/plugin/federated-runs")
    sandbox = page.locator("iframe").get_attribute("sandbox") or ""
    assert "allow-top-navigation" not in sandbox and "allow-popups" not in sandbox, sandbox  # what we work with
    frame = page.frame_locator("iframe")
    frame.locator(f'tr[data-dag="{ONE_DOWN}"] td a').first.click()  # inside the frame: the DAG's runs
    frame.locator("a.airflow").click()  # "in Airflow"
    page.wait_for_url(f"{stack.base}/dags/{ONE_DOWN}", timeout=60_000)
    # Airflow's run page has a "Federated run" tab (the plugin's dag_run view) ...
    run = stack.runs[ONE_DOWN]
    page.goto(f"{stack.base}/dags/{ONE_DOWN}/runs/{quote(run, safe='')}/plugin/federated-run")
    frame = page.frame_locator("iframe")
    frame.locator('td[data-round="1"][data-site="site-4"]').wait_for(timeout=60_000)
    _shot(page, stack, "run-tab-in-airflow")
    # ... whose "log" links open the task's log in Airflow, in the top window.
    frame.locator('td[data-round="1"][data-site="site-4"] a.log').click()
    page.wait_for_url(lambda url: "/tasks/round_1.site-4" in url and "try_number=1" in url, timeout=60_000)
    assert page.url.startswith(f"{stack.base}/dags/{ONE_DOWN}/runs/")


def test_prepare_failure_asset_link_headers_and_bad_token(stack: Stack, browser: Browser) -> None:
    """Issue 28 #8: a run failing in prepare shows its reason and the verdict's on the page; the
    model's Asset event leads to the page; HTML has CSP and nosniff; a bad token gets 401."""
    assert stack.api.wait(NO_QUORUM, stack.runs[NO_QUORUM]) == "failed"
    bad_run = stack.api.trigger(NO_QUORUM, {"roundz": 2})
    # Issue 37 #7: a run id "." failed prepare with no reason (the task runtime cannot address it).
    # Triggered now: it queues behind the first (max_active_runs=1) and runs while this test reads
    # the first one's page.
    dot = stack.api("POST", f"/dags/{NO_QUORUM}/dagRuns", json={"dag_run_id": ".", "logical_date": None})
    assert stack.api.wait(NO_QUORUM, bad_run) == "failed"
    states = stack.api.task_states(NO_QUORUM, bad_run)
    assert states["prepare"] == "failed" and states["publish"] == "failed" and states["verdict"] == "failed"
    page = _page(browser, stack, stack.admin)
    page.goto(f"{stack.base}/flare/run?dag_id={NO_QUORUM}&run_id={quote(bad_run, safe='')}")
    _shot(page, stack, "prepare-failed")
    rows = {
        el.get_attribute("data-task"): el.locator("td.reason").inner_text()
        for el in page.locator("table.failures tr[data-task]").all()
    }
    assert set(rows) == {"prepare", "publish", "verdict"}, rows
    assert "unknown run parameter(s) 'roundz' (did you mean 'rounds'?)" in rows["prepare"]
    assert rows["prepare"].endswith("allowed: rounds, min_clients, warm_start"), rows["prepare"]  # whole
    assert f"flare-airflow resume {NO_QUORUM} {bad_run}" in rows["verdict"]
    assert stack.api.wait(NO_QUORUM, "%2E") == "failed"
    page.goto(f"{stack.base}/flare/run?dag_id={NO_QUORUM}&run_id={quote(dot['dag_run_id'], safe='')}")
    reason = page.locator('table.failures tr[data-task="prepare"] td.reason').inner_text()
    assert reason.startswith("Airflow's task runtime cannot serve a run with the id '.'"), reason

    # The published model's Asset event names the run's page.
    events = stack.api("GET", "/assets/events", params={"source_dag_id": ONE_DOWN})["asset_events"]
    pages = {e["source_run_id"]: e["extra"].get("federated_run_page") for e in events}
    # A whole URL (issue 37 #7): the Asset page shows the extra as text, which a path cannot open.
    expected = f"{stack.base}/flare/run?dag_id={ONE_DOWN}&run_id={quote(stack.runs[ONE_DOWN])}"
    assert pages[stack.runs[ONE_DOWN]] == expected
    page.goto(pages[stack.runs[ONE_DOWN]])
    assert page.locator('table.rounds td[data-site="site-4"]').count() == 2

    admin = {"Authorization": f"Bearer {stack.admin}"}
    html = httpx.get(f"{stack.base}/flare/dag", params={"dag_id": ONE_DOWN}, headers=admin, timeout=30)
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in html.headers["content-security-policy"]
    assert html.headers["x-content-type-options"] == "nosniff"
    script = httpx.get(f"{stack.base}/flare/static/page.js", headers=admin, timeout=30)
    assert script.headers["content-type"].startswith("text/javascript") and "data-airflow" in script.text
    bad = httpx.get(f"{stack.base}/flare/", headers={"Authorization": "Bearer not-a-token"}, timeout=30)
    assert bad.status_code == 401 and bad.headers["www-authenticate"] == "Bearer", (bad.status_code, bad.text)


# What an operator types into the lr field, key by key, and what must train (or the sentence that refuses it).
TYPED_LR: dict[str, float | str] = {
    "0.001": 0.001,
    "0.0005": 0.0005,
    "1e-3": 0.001,
    "5e-4": 0.0005,
    "3": "hp_lr=3.0 is above the job's maximum 1.0 (trainer.hparam_ranges)",
    "-1": "hp_lr=-1.0 is below the job's minimum 0.0 (trainer.hparam_ranges)",
    "abc": "hp_lr must be a finite number like the job's default 0.01, got 'abc'",
}


def test_a_float_typed_key_by_key_into_airflows_trigger_dialog_is_what_trains(stack: Stack, browser: Browser) -> None:
    """Issue 37 #1: Airflow's JSON box for a param of several types re-read the text at each key:
    typed 0.001 arrived as 001 and trained at 1.0. Typed here one key at a time into Airflow's own
    dialog; the run's conf keeps the text, prepare and the trainer get the number, and what is no
    number in range is refused by prepare with a sentence before any site trains."""
    from flare_airflow.core.config import load_job
    from flare_airflow.operators.common import RunParamsError, run_params

    page = _page(browser, stack, stack.admin)
    job = load_job(stack.root / "dags" / "typed.yaml")
    runs: dict[str, str] = {}
    for text in TYPED_LR:
        page.goto(f"{stack.base}/dags/{TYPED}")
        page.get_by_role("button", name="Trigger").first.click()
        dialog = page.locator("[data-scope=dialog][data-part=content][data-state=open]")
        # Kept paused: the runs queue, and only the ones this test lets go run (the others are
        # checked with prepare's own function, below).
        dialog.get_by_text(f"Unpause {TYPED} on trigger").click()
        dialog.get_by_text("Trainer hyper-parameters").click()
        field = dialog.locator("#element_hp_lr")
        assert field.evaluate("e => e.tagName") == "INPUT"  # one line for one number, not a JSON box
        field.click()
        field.press("Control+a")
        field.press("Delete")
        field.press_sequentially(text, delay=20)
        assert field.input_value() == text
        with page.expect_response(lambda r: r.url.endswith("/dagRuns") and r.request.method == "POST") as answer:
            dialog.get_by_role("button", name="Trigger").click()
        assert answer.value.status == 200, answer.value.text()
        run = answer.value.json()
        assert run["conf"]["hp_lr"] == text, run["conf"]  # what was typed, as typed
        runs[text] = run["dag_run_id"]
    _shot(page, stack, "typed-dialog")
    for text, expected in TYPED_LR.items():
        conf = stack.api("GET", f"/dags/{TYPED}/dagRuns/{quote(runs[text], safe='')}")["conf"]
        context = {"params": {**conf}, "dag_run": type("Run", (), {"conf": conf})()}
        if isinstance(expected, float):
            assert run_params(context, job).hparams["lr"] == expected, text
        else:
            with pytest.raises(RunParamsError, match=re.escape(expected)):
                run_params(context, job)
    # The real run of 0.001 and of the refusals: what prepare resolved, what the trainer got, and
    # the sentence on the run's page.
    let_go = ["0.001", "abc"]
    for text in TYPED_LR:
        if text not in let_go:
            stack.api("DELETE", f"/dags/{TYPED}/dagRuns/{quote(runs[text], safe='')}")
    stack.api("PATCH", f"/dags/{TYPED}", json={"is_paused": False})
    assert stack.api.wait(TYPED, runs["0.001"]) == "success"
    prepared = stack.api(
        "GET", f"/dags/{TYPED}/dagRuns/{quote(runs['0.001'], safe='')}/taskInstances/prepare/xcomEntries/return_value"
    )["value"]
    assert prepared["hparams"] == {"lr": 0.001, "local_epochs": 5}
    (echo,) = stack.root.rglob("echo.json")  # only this run trained
    assert json.loads(echo.read_text())["hparams"]["lr"] == 0.001  # what the site trained with
    # Issue 37 #5: what a render costs the api-server, from its access log: the first render of
    # the finished run reads the run, its tasks and their XComs; the next ones the run only.
    access_log = stack.airflow.home / "local" / "api-server.log"
    calls = []
    for _ in range(2):
        before = access_log.stat().st_size
        page.goto(f"{stack.base}/flare/run?dag_id={TYPED}&run_id={quote(runs['0.001'], safe='')}")
        time.sleep(1)  # the access log line is written once the response is sent
        with access_log.open("rb") as fh:
            fh.seek(before)
            calls.append(fh.read().decode(errors="replace").count(f"path=/api/v2/dags/{TYPED}/dagRuns/"))
    print(f"REST calls per render of a finished run: {calls}")
    assert calls[0] >= 5 and calls[1] == 1, calls
    # Issue 37 #2: the page names the strategy and its parameters, and the ε the site reported.
    _shot(page, stack, "typed-run")
    assert page.locator("table.rounds th.strategy").inner_text() == "global model (fedadam)"
    assert "fedadam eta=0.05" in page.locator("h2:text('Parameters') + table").inner_text()
    spent = epsilon_after(1.1, 1, 1.0e-5)
    site = page.locator('table.rounds td[data-round="1"][data-site="site-1"] small.epsilon')
    assert float(site.get_attribute("data-value") or "nan") == pytest.approx(spent)
    aggregate = page.locator('table.rounds td.aggregate[data-round="1"] small.epsilon')
    assert f"ε ≤ {spent:.3f} (sites)" == aggregate.inner_text()
    for text in ("abc",):
        assert stack.api.wait(TYPED, runs[text]) == "failed"
        page.goto(f"{stack.base}/flare/run?dag_id={TYPED}&run_id={quote(runs[text], safe='')}")
        reason = page.locator('table.failures tr[data-task="prepare"] td.reason').inner_text()
        assert reason == f"invalid run parameters: {TYPED_LR[text]}", reason
        assert "Failed validating" not in page.content()
    # Issue 37 #6: nothing the runs left behind stays <defunct> under the launcher (it reaps each second).
    launcher = stack.airflow.proc.pid if stack.airflow.proc else 0
    deadline = time.monotonic() + 10
    while (zombies := _defunct_children(launcher)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not zombies, zombies


def _defunct_children(parent: int) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]
        if state == "Z" and int(ppid) == parent:
            found.append(stat[: stat.rfind(")") + 1])
    return found
