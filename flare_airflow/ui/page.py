"""HTML of the Federated runs page (server-rendered; the only script refreshes a running run)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from flare_airflow.core.page_paths import PREFIX, dag_page_path, run_page_path
from flare_airflow.ui import svg
from flare_airflow.ui.view import RunFailure, RunView, charts

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px;color:#1a202c;font-size:14px}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:20px 0 8px}
a{color:#2b6cb0}table{border-collapse:collapse;margin:4px 0}
th,td{border:1px solid #cbd5e0;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#edf2f7}td.num{text-align:right;font-variant-numeric:tabular-nums}
.state{font-weight:600;border-radius:4px;padding:0 4px}
.s-success{background:#c6f6d5}.s-failed,.s-upstream_failed{background:#fed7d7}
.s-skipped{background:#fbd38d40}.s-not-counted{background:#fefcbf}
.s-running,.s-queued,.s-scheduled,.s-deferred,.s-up_for_retry{background:#bee3f8}
.cell small{display:block;color:#4a5568}.reason{max-width:420px;overflow-wrap:anywhere}
.try{font-weight:600}
.sha{font-family:monospace;font-size:12px}
.charts{display:flex;flex-wrap:wrap;gap:12px}
svg.chart{border:1px solid #e2e8f0;background:#fff}
svg .title{font-size:13px;font-weight:600}svg .frame{fill:none;stroke:#a0aec0}
svg .grid{stroke:#edf2f7}svg .ytick{font-size:10px;text-anchor:end}svg .xtick{font-size:10px;text-anchor:middle}
svg .xlabel,svg .ylabel{font-size:11px;text-anchor:middle}svg .legend{font-size:11px}
svg .line{fill:none;stroke-width:2}svg .reference{stroke:#e53e3e;stroke-dasharray:6 4;stroke-width:1.5}
svg .empty{font-size:12px;fill:#718096}.muted{color:#718096}
"""

# The page's only script (served as /flare/static/page.js: the Content-Security-Policy allows no
# inline script). It follows links into Airflow's UI and refreshes a running run.
#
# Airflow 3.3 shows this page in an iframe sandboxed with "allow-scripts allow-same-origin
# allow-forms allow-downloads" (airflow/ui: the plugin's external view): no allow-top-navigation
# and no allow-popups, so a target=_top or target=_blank link does nothing there (Chromium: "Unsafe
# attempt to initiate navigation"). The frame is same-origin with Airflow's UI, so a link into
# Airflow is followed by an anchor created in the top document -- a navigation the unsandboxed top
# document makes itself. Ctrl/Cmd/Shift/middle click open a new tab from there. Outside a frame the
# links are plain links. A link out of Airflow (the run in MLflow's UI, ``data-top``) goes the same way.
SCRIPT = """(function () {
  "use strict";
  function topDocument() {
    try {
      if (window.top !== window && window.top.document && window.top.document.body) return window.top.document;
    } catch (e) { /* another origin: plain links */ }
    return null;
  }
  function follow(href, newTab) {
    var doc = topDocument();
    var a = doc.createElement("a");
    a.href = href;
    a.rel = "noopener";
    if (newTab) a.target = "_blank";
    doc.body.appendChild(a);
    a.click();
    a.remove();
  }
  function onClick(ev) {
    var a = ev.target && ev.target.closest ? ev.target.closest("a[data-airflow], a[data-top]") : null;
    if (!a || !topDocument() || (ev.type === "auxclick" && ev.button !== 1)) return;
    ev.preventDefault();
    follow(a.href, ev.ctrlKey || ev.metaKey || ev.shiftKey || ev.button === 1);
  }
  document.addEventListener("click", onClick);
  document.addEventListener("auxclick", onClick);
  var content = document.getElementById("content");
  var every = content ? Number(content.getAttribute("data-refresh-ms")) : 0;
  if (every > 0) {
    var timer = setInterval(function () {
      var url = new URL(window.location.href);
      url.searchParams.set("fragment", "1");
      fetch(url, {credentials: "same-origin"}).then(function (r) {
        if (!r.ok) throw r;
        return r.text();
      }).then(function (html) {
        content.innerHTML = html;
        if (content.querySelector('[data-finished="true"]')) clearInterval(timer);
      }).catch(function () {});
    }, every);
  }
})();
"""


def _doc(ui_base: str, title: str, body: str) -> str:
    static = f"{ui_base}{PREFIX}/static"
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f'<link rel="stylesheet" href="{static}/page.css"><script src="{static}/page.js" defer></script>'
        f"</head><body>{body}</body></html>"
    )


def ui_link(ui_base: str, dag_id: str, run_id: str | None = None, task_id: str | None = None, **query: Any) -> str:
    """A link into Airflow's own UI (followed in the top window by :data:`SCRIPT`).

    Airflow's UI takes ids in the path only; a browser resolves a segment ``..`` (or ``%2E%2E``)
    whatever the encoding, so a DAG or run id that is exactly ``.`` or ``..`` has no working link
    there (the page's own links carry ids in the query, see :mod:`flare_airflow.core.page_paths`).
    """
    url = f"{ui_base}/dags/{quote(dag_id, safe='')}"
    if run_id is not None:
        url += f"/runs/{quote(run_id, safe='')}"
    if task_id is not None:
        url += f"/tasks/{quote(task_id, safe='')}"
    if query:
        url += "?" + urlencode(query)
    return url


def _airflow_a(href: str, text: str, cls: str = "") -> str:
    """An anchor into Airflow's UI: ``data-airflow`` marks it for :data:`SCRIPT`."""
    klass = f' class="{cls}"' if cls else ""
    return f'<a{klass} data-airflow href="{escape(href)}">{escape(text)}</a>'


def _state(state: str) -> str:
    return f'<span class="state s-{escape(state.replace(" ", "-"))}">{escape(state)}</span>'


def index_page(ui_base: str, dags: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for dag in dags:
        dag_id = str(dag["dag_id"])
        runs = dag.get("runs") or []
        last = runs[0] if runs else None
        last_cell = (
            f'<a href="{escape(run_page_path(dag_id, str(last["dag_run_id"]), ui_base))}">'
            f"{escape(str(last['dag_run_id']))}</a> {_state(str(last.get('state')))}"
            if last
            else '<span class="muted">no run yet</span>'
        )
        rows.append(
            f'<tr data-dag="{escape(dag_id)}"><td><a href="{escape(dag_page_path(dag_id, ui_base))}">'
            f"{escape(dag_id)}</a></td><td>{escape(str(dag.get('description') or ''))}</td><td>{last_cell}</td></tr>"
        )
    table = (
        "<table><tr><th>DAG</th><th>job</th><th>latest run</th></tr>" + "".join(rows) + "</table>"
        if rows
        else '<p class="muted">No federated DAG (tag <code>federated-learning</code>) that you may read.</p>'
    )
    return _doc(ui_base, "Federated runs", f"<h1>Federated runs</h1>{table}")


def dag_page(
    ui_base: str,
    dag_id: str,
    runs: Sequence[Mapping[str, Any]],
    announcements: Mapping[str, Mapping[str, Any]] | None = None,
    description: str = "",
    watch: str | None = None,
) -> str:
    rows = [
        f'<tr data-run="{escape(str(r["dag_run_id"]))}"><td><a href="'
        f'{escape(run_page_path(dag_id, str(r["dag_run_id"]), ui_base))}">{escape(str(r["dag_run_id"]))}</a></td>'
        f"<td>{_state(str(r.get('state')))}</td><td>{escape(str(r.get('start_date') or ''))}</td>"
        f"<td>{escape(json.dumps(r.get('conf') or {}, sort_keys=True))}</td></tr>"
        for r in runs
    ]
    body = (
        f'<p><a href="{ui_base}{PREFIX}/">Federated runs</a> / {escape(dag_id)} '
        f"({_airflow_a(ui_link(ui_base, dag_id), 'in Airflow', 'airflow')})</p><h1>{escape(dag_id)}</h1>"
        "<table><tr><th>run</th><th>state</th><th>started</th><th>conf</th></tr>"
        + "".join(rows)
        + "</table>"
        + announcements_table(ui_base, dag_id, announcements or {}, description)
        + (f'<p class="watch">Data watch (wait, fallback): {escape(watch)}</p>' if watch else "")
    )
    return _doc(ui_base, dag_id, body)


def never_ran(state: str, try_number: int) -> bool:
    """A task that never started has no log to link to (Airflow shows an empty one)."""
    return try_number == 0 or state in ("upstream_failed", "none", "removed")


def _tries(try_number: int) -> str:
    return f'<small class="try">try {try_number}</small>' if try_number > 1 else ""


def _reason(reason: str) -> str:
    """A task's reason, whole: cut, the part that says what to do is the part that goes."""
    return f'<small class="reason">{escape(reason)}</small>'


def _cell(view: RunView, ui_base: str, site: str, r: int) -> str:
    rnd = next(x for x in view.rounds if x.round == r)
    cell = rnd.sites[site]
    extra = [_tries(cell.try_number)]
    if cell.num_samples is not None:
        extra.append(f'<small class="samples">samples {cell.num_samples}</small>')
    if cell.train_loss is not None:
        extra.append(f'<small class="loss">train loss {cell.train_loss:.4f}</small>')
    if cell.epsilon is not None:
        extra.append(f'<small class="epsilon" data-value="{cell.epsilon!r}">ε {cell.epsilon:.3f}</small>')
    if cell.releases is not None:
        extra.append(f'<small class="releases">releases {cell.releases}</small>')
    if cell.reason:
        extra.append(_reason(cell.reason))
    if not never_ran(cell.state, cell.try_number):
        link = ui_link(ui_base, view.dag_id, view.run_id, cell.task_id, try_number=cell.try_number)
        extra.append(f"<small>{_airflow_a(link, 'log', 'log')}</small>")
    return (
        f'<td class="cell" data-round="{r}" data-site="{escape(site)}" data-state="{escape(cell.state)}">'
        f"{_state(cell.state)}{''.join(extra)}</td>"
    )


def _no_reason(view: RunView, failure: RunFailure) -> str:
    """What to say of a run task that left no reason: for one that never ran, which tasks failed."""
    if view.run_id in (".", "..") and failure.state == "failed":
        # The Task SDK's HTTP client drops "." and ".." path segments (RFC 3986): a task of this
        # run cannot reach its run's XComs, not even to leave its reason.
        return (
            f"Airflow's task runtime cannot serve a run with the id {view.run_id!r}: its API client drops '.' and "
            "'..' path segments, so the task could not read or write its XComs (nor leave a reason). Trigger the "
            "run again with another run id (or none: Airflow makes one)"
        )
    if failure.state != "upstream_failed":
        return "no reason recorded: see the log"
    failed = [f.task_id for f in view.failures if f.state == "failed" and f.task_id != failure.task_id]
    failed += [r.aggregate_task_id for r in view.rounds if r.aggregate_state == "failed"]
    if not failed:
        return "not run: a task it waits for did not succeed"
    return f"not run: a task it waits for failed ({', '.join(failed)}); its reason is shown there"


def _run_failures(view: RunView, ui_base: str) -> str:
    """The run's own tasks that failed (prepare, publish, the verdict): state, tries, reason."""
    if not view.failures:
        return ""
    rows = []
    for f in view.failures:
        log = ui_link(ui_base, view.dag_id, view.run_id, f.task_id, try_number=f.try_number or 1)
        rows.append(
            f'<tr data-task="{escape(f.task_id)}" data-state="{escape(f.state)}"><td>{escape(f.task_id)}</td>'
            f"<td>{_state(f.state)}{_tries(f.try_number)}</td>"
            f'<td class="reason">{escape(f.reason or _no_reason(view, f))}</td>'
            f"<td>{'' if never_ran(f.state, f.try_number) else _airflow_a(log, 'log', 'log')}</td></tr>"
        )
    return (
        '<h2>Run failures</h2><table class="failures"><tr><th>task</th><th>state</th><th>reason</th><th></th></tr>'
        f"{''.join(rows)}</table>"
    )


def run_content(view: RunView, ui_base: str, downloads: Sequence[Mapping[str, Any]]) -> str:
    """The part of the run page that refreshes."""
    head = "".join(f"<th>{escape(s)}</th>" for s in view.sites)
    body = []
    for rnd in view.rounds:
        agg_link = ui_link(ui_base, view.dag_id, view.run_id, rnd.aggregate_task_id, try_number=rnd.try_number or 1)
        valid = _tries(rnd.try_number)
        valid += "" if rnd.valid is None else f"<small>{rnd.valid}/{len(view.sites)} valid</small>"
        if rnd.epsilon is not None:
            valid += f'<small class="epsilon" data-value="{rnd.epsilon!r}">ε {rnd.epsilon:.3f}</small>'
        elif site_eps := [c.epsilon for c in rnd.sites.values() if c.epsilon is not None]:
            # Noise added by the sites' own filters: the round is as private as its least private site.
            valid += f'<small class="epsilon" data-value="{max(site_eps)!r}">ε ≤ {max(site_eps):.3f} (sites)</small>'
        if rnd.reason:
            valid += _reason(rnd.reason)
        body.append(
            f'<tr data-round="{rnd.round}"><th>round {rnd.round}</th>'
            + "".join(_cell(view, ui_base, s, rnd.round) for s in view.sites)
            + f'<td class="cell aggregate" data-round="{rnd.round}" data-state="{escape(rnd.aggregate_state)}">'
            f"{_state(rnd.aggregate_state)}{valid}<small>{_airflow_a(agg_link, 'log', 'log')}</small></td></tr>"
        )
    if view.rounds:
        table = (
            f'<table class="rounds"><tr><th>round</th>{head}<th class="strategy">global model'
            f"{f' ({escape(view.strategy)})' if view.strategy else ''}</th></tr>{''.join(body)}</table>"
        )
    else:
        table = (
            '<p class="muted">This run has no federated rounds: its DAG holds no task '
            "<code>round_N.global_model</code> (not a flare-airflow job?).</p>"
        )
    if view.rows:
        figures = "".join(svg.render(c) for c in charts(view))
    else:  # four empty charts say less than one sentence
        figures = '<p class="muted no-charts">No round has been aggregated in this run: nothing to chart yet.</p>'

    listed = dict(view.params)
    if view.strategy:
        listed["strategy"] = " ".join(
            [view.strategy, *(f"{k}={json.dumps(v)}" for k, v in sorted(view.strategy_params.items()))]
        )
    params = "".join(
        f"<tr><th>{escape(k)}</th><td>{escape(v if isinstance(v, str) else json.dumps(v, sort_keys=True))}</td></tr>"
        for k, v in listed.items()
        if v not in (None, {}, "")
    )
    tracked = ""
    if view.mlflow_run is not None:
        run = view.mlflow_run
        label = f"run {run['run_id']} (experiment {run['experiment_id']})"
        shown = (
            f'<a class="mlflow" data-top href="{escape(str(run["url"]))}">{escape(label)}</a>'
            if run["url"]
            else escape(label)
        )
        tracked = f'<p class="tracking">MLflow: {shown}</p>'
    if downloads:
        files = "".join(
            f'<tr data-file="{escape(d["name"])}"><td><a class="download" href="{escape(d["href"])}">'
            f'{escape(d["label"])}</a></td><td class="num">{d["size"]}</td>'
            f'<td class="sha">{escape(d["sha256"])}</td><td>{escape(d["sha256_from"])}</td></tr>'
            for d in downloads
        )
        files = f"<table><tr><th>file</th><th>bytes</th><th>sha256</th><th>sha256 from</th></tr>{files}</table>"
    elif any(f.task_id.rsplit(".", 1)[-1] == "publish" and f.state == "failed" for f in view.failures):
        # A failed re-run of publish leaves no XCom to read, while what an earlier try wrote stays.
        files = (
            '<p class="muted unpublished">Not published: the latest try of <code>publish</code> failed (its '
            "reason is under Run failures). Files and the Asset event an earlier try of it published, if any, "
            "remain in the model store and in Airflow until a try succeeds.</p>"
        )
    else:
        files = '<p class="muted">Published when the run succeeds (task <code>publish</code>).</p>'
    return (
        f'<div data-finished="{"true" if view.finished else "false"}" data-state="{escape(view.state)}">'
        f"<p>state {_state(view.state)} · per-round values from {escape(view.rows_from)}"
        f"{'' if view.finished else ' · refreshing every 5 s'}</p>{_run_failures(view, ui_base)}"
        f'<h2>Rounds &times; sites</h2>{table}<h2>Per round</h2><div class="charts">{figures}</div>'
        f"{_site_data(view)}<h2>Parameters</h2><table>{params}</table><h2>Outputs</h2>{files}{tracked}</div>"
    )


def _site_data(view: RunView) -> str:
    """The data each site trained on in a run driven by the sites' data, or why it sat it out."""
    if not view.site_data:
        return ""
    rows = "".join(
        f'<tr data-site="{escape(site)}"><th>{escape(site)}</th><td>{escape(str(d.get("version") or ""))}</td>'
        f'<td class="num">{escape(str(d.get("samples") or ""))}</td><td>{escape(str(d.get("announced_at") or ""))}</td>'
        f"<td>{_reason(str(d['reason'])) if d.get('reason') else 'trained on it'}</td></tr>"
        for site, d in sorted(view.site_data.items())
    )
    return (
        '<h2>Site data</h2><table class="site-data"><tr><th>site</th><th>data version</th><th>samples</th>'
        f"<th>announced</th><th>in this run</th></tr>{rows}</table>"
    )


def _consumed_by(ui_base: str, dag_id: str, run_id: Any) -> str:
    if not run_id:
        return '<td class="muted">not consumed yet: waits for the quorum of the next run</td>'
    return f'<td><a href="{escape(run_page_path(dag_id, str(run_id), ui_base))}">{escape(str(run_id))}</a></td>'


def announcements_table(
    ui_base: str, dag_id: str, latest: Mapping[str, Mapping[str, Any]], description: str = ""
) -> str:
    """Per site: its latest announced data version and when, and which run of the job consumed it;
    above it, how many sites wait for a run and what starts one (the DAG's description)."""
    if not latest:
        return ""
    waiting = sorted(site for site, a in latest.items() if not a.get("run_id"))
    status = (
        f'<p class="waiting">{len(waiting)} site(s) announced data no run has used yet: {escape(", ".join(waiting))}. '
        f"No run yet: {escape(description) or 'the job waits for its quorum of sites'}.</p>"
        if waiting
        else ""
    )
    rows = "".join(
        f'<tr data-site="{escape(site)}"><th>{escape(site)}</th><td>{escape(str(a.get("version") or ""))}</td>'
        f'<td class="num">{escape(str(a.get("samples") or ""))}</td><td>{escape(str(a.get("announced_at") or ""))}</td>'
        f"{_consumed_by(ui_base, dag_id, a.get('run_id'))}</tr>"
        for site, a in sorted(latest.items())
    )
    return (
        f'<h2>Site data</h2>{status}<table class="announcements"><tr><th>site</th><th>latest data version</th>'
        f"<th>samples</th><th>announced</th><th>consumed by run</th></tr>{rows}</table>"
    )


def run_page(view: RunView, ui_base: str, downloads: Sequence[Mapping[str, Any]], refresh_ms: int = 5000) -> str:
    run_link = ui_link(ui_base, view.dag_id, view.run_id)
    refresh = "" if view.finished else f' data-refresh-ms="{int(refresh_ms)}"'
    body = (
        f'<p><a href="{ui_base}{PREFIX}/">Federated runs</a> / '
        f'<a href="{escape(dag_page_path(view.dag_id, ui_base))}">{escape(view.dag_id)}</a> / '
        f"{escape(view.run_id)} ({_airflow_a(run_link, 'in Airflow', 'airflow')})</p>"
        f"<h1>{escape(view.dag_id)} — {escape(view.run_id)}</h1>"
        f'<div id="content"{refresh}>{run_content(view, ui_base, downloads)}</div>'
    )
    return _doc(ui_base, f"{view.dag_id} {view.run_id}", body)
