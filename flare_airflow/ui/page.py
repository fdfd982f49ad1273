"""HTML of the Federated runs page (server-rendered; the only script refreshes a running run)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any
from urllib.parse import quote

from flare_airflow.ui import svg
from flare_airflow.ui.view import RunView, charts

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
.cell small{display:block;color:#4a5568}.reason{max-width:280px;overflow-wrap:anywhere}
.sha{font-family:monospace;font-size:12px}
.charts{display:flex;flex-wrap:wrap;gap:12px}
svg.chart{border:1px solid #e2e8f0;background:#fff}
svg .title{font-size:13px;font-weight:600}svg .frame{fill:none;stroke:#a0aec0}
svg .grid{stroke:#edf2f7}svg .ytick{font-size:10px;text-anchor:end}svg .xtick{font-size:10px;text-anchor:middle}
svg .xlabel,svg .ylabel{font-size:11px;text-anchor:middle}svg .legend{font-size:11px}
svg .line{fill:none;stroke-width:2}svg .reference{stroke:#e53e3e;stroke-dasharray:6 4;stroke-width:1.5}
svg .empty{font-size:12px;fill:#718096}.muted{color:#718096}
"""

# Replaces #content with a fresh render every few seconds while the run is not finished.
REFRESH = """<script>
(function(){var t=setInterval(function(){fetch(location.pathname+'?fragment=1',{credentials:'same-origin'})
.then(function(r){if(!r.ok)throw r;return r.text()}).then(function(h){
var c=document.getElementById('content');c.innerHTML=h;
if(c.querySelector('[data-finished="true"]'))clearInterval(t)}).catch(function(){})},%d)})();
</script>"""


def _doc(title: str, body: str) -> str:
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{body}</body></html>"
    )


def ui_link(ui_base: str, dag_id: str, run_id: str | None = None, task_id: str | None = None, **query: Any) -> str:
    """A link into Airflow's own UI (opened in the top window: this page lives in an iframe)."""
    url = f"{ui_base}/dags/{quote(dag_id, safe='')}"
    if run_id is not None:
        url += f"/runs/{quote(run_id, safe='')}"
    if task_id is not None:
        url += f"/tasks/{quote(task_id, safe='')}"
    if query:
        url += "?" + "&".join(f"{k}={quote(str(v), safe='')}" for k, v in query.items())
    return url


def _state(state: str) -> str:
    return f'<span class="state s-{escape(state.replace(" ", "-"))}">{escape(state)}</span>'


def index_page(base: str, dags: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for dag in dags:
        dag_id = str(dag["dag_id"])
        runs = dag.get("runs") or []
        last = runs[0] if runs else None
        last_cell = (
            f'<a href="{base}/dags/{quote(dag_id, safe="")}/runs/{quote(str(last["dag_run_id"]), safe="")}">'
            f"{escape(str(last['dag_run_id']))}</a> {_state(str(last.get('state')))}"
            if last
            else '<span class="muted">no run yet</span>'
        )
        rows.append(
            f'<tr data-dag="{escape(dag_id)}"><td><a href="{base}/dags/{quote(dag_id, safe="")}">{escape(dag_id)}</a>'
            f"</td><td>{escape(str(dag.get('description') or ''))}</td><td>{last_cell}</td></tr>"
        )
    table = (
        "<table><tr><th>DAG</th><th>job</th><th>latest run</th></tr>" + "".join(rows) + "</table>"
        if rows
        else '<p class="muted">No federated DAG (tag <code>federated-learning</code>) that you may read.</p>'
    )
    return _doc("Federated runs", f"<h1>Federated runs</h1>{table}")


def dag_page(base: str, ui_base: str, dag_id: str, runs: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        f'<tr data-run="{escape(str(r["dag_run_id"]))}"><td><a href="{base}/dags/{quote(dag_id, safe="")}/runs/'
        f'{quote(str(r["dag_run_id"]), safe="")}">{escape(str(r["dag_run_id"]))}</a></td>'
        f"<td>{_state(str(r.get('state')))}</td><td>{escape(str(r.get('start_date') or ''))}</td>"
        f"<td>{escape(json.dumps(r.get('conf') or {}, sort_keys=True))}</td></tr>"
        for r in runs
    ]
    body = (
        f'<p><a href="{base}/">Federated runs</a> / {escape(dag_id)} '
        f'(<a target="_top" href="{ui_link(ui_base, dag_id)}">in Airflow</a>)</p><h1>{escape(dag_id)}</h1>'
        "<table><tr><th>run</th><th>state</th><th>started</th><th>conf</th></tr>" + "".join(rows) + "</table>"
    )
    return _doc(dag_id, body)


def _cell(view: RunView, ui_base: str, site: str, r: int) -> str:
    rnd = next(x for x in view.rounds if x.round == r)
    cell = rnd.sites[site]
    extra = []
    if cell.num_samples is not None:
        extra.append(f'<small class="samples">samples {cell.num_samples}</small>')
    if cell.train_loss is not None:
        extra.append(f'<small class="loss">train loss {cell.train_loss:.4f}</small>')
    if cell.reason:
        extra.append(f'<small class="reason" title="{escape(cell.reason)}">{escape(cell.reason[:80])}</small>')
    link = ui_link(ui_base, view.dag_id, view.run_id, cell.task_id, try_number=cell.try_number or 1)
    extra.append(f'<small><a class="log" target="_top" href="{escape(link)}">log</a></small>')
    return (
        f'<td class="cell" data-round="{r}" data-site="{escape(site)}" data-state="{escape(cell.state)}">'
        f"{_state(cell.state)}{''.join(extra)}</td>"
    )


def run_content(view: RunView, base: str, ui_base: str, downloads: Sequence[Mapping[str, Any]]) -> str:
    """The part of the run page that refreshes."""
    head = "".join(f"<th>{escape(s)}</th>" for s in view.sites)
    body = []
    for rnd in view.rounds:
        agg_link = ui_link(ui_base, view.dag_id, view.run_id, rnd.aggregate_task_id)
        valid = "" if rnd.valid is None else f"<small>{rnd.valid}/{len(view.sites)} valid</small>"
        if rnd.epsilon is not None:
            valid += f'<small class="epsilon">ε {rnd.epsilon:.3f}</small>'
        if rnd.reason:
            valid += f'<small class="reason" title="{escape(rnd.reason)}">{escape(rnd.reason[:160])}</small>'
        body.append(
            f'<tr data-round="{rnd.round}"><th>round {rnd.round}</th>'
            + "".join(_cell(view, ui_base, s, rnd.round) for s in view.sites)
            + f'<td class="cell aggregate" data-round="{rnd.round}" data-state="{escape(rnd.aggregate_state)}">'
            f'{_state(rnd.aggregate_state)}{valid}<small><a target="_top" href="{escape(agg_link)}">log</a></small>'
            "</td></tr>"
        )
    table = f'<table class="rounds"><tr><th>round</th>{head}<th>global model (FedAvg)</th></tr>{"".join(body)}</table>'
    figures = "".join(svg.render(c) for c in charts(view))
    params = "".join(
        f"<tr><th>{escape(k)}</th><td>{escape(v if isinstance(v, str) else json.dumps(v, sort_keys=True))}</td></tr>"
        for k, v in view.params.items()
        if v not in (None, {}, "")
    )
    if downloads:
        files = "".join(
            f'<tr data-file="{escape(d["name"])}"><td><a class="download" href="{escape(d["href"])}">'
            f'{escape(d["label"])}</a></td><td class="num">{d["size"]}</td>'
            f'<td class="sha">{escape(d["sha256"])}</td><td>{escape(d["sha256_from"])}</td></tr>'
            for d in downloads
        )
        files = f"<table><tr><th>file</th><th>bytes</th><th>sha256</th><th>sha256 from</th></tr>{files}</table>"
    else:
        files = '<p class="muted">Published when the run succeeds (task <code>publish</code>).</p>'
    return (
        f'<div data-finished="{"true" if view.finished else "false"}" data-state="{escape(view.state)}">'
        f"<p>state {_state(view.state)} · per-round values from {escape(view.rows_from)}"
        f"{'' if view.finished else ' · refreshing every 5 s'}</p>"
        f'<h2>Rounds &times; sites</h2>{table}<h2>Per round</h2><div class="charts">{figures}</div>'
        f"<h2>Parameters</h2><table>{params}</table><h2>Outputs</h2>{files}</div>"
    )


def run_page(
    view: RunView, base: str, ui_base: str, downloads: Sequence[Mapping[str, Any]], refresh_ms: int = 5000
) -> str:
    dag_q, run_link = quote(view.dag_id, safe=""), ui_link(ui_base, view.dag_id, view.run_id)
    body = (
        f'<p><a href="{base}/">Federated runs</a> / <a href="{base}/dags/{dag_q}">{escape(view.dag_id)}</a> / '
        f'{escape(view.run_id)} (<a target="_top" href="{escape(run_link)}">in Airflow</a>)</p>'
        f"<h1>{escape(view.dag_id)} — {escape(view.run_id)}</h1>"
        f'<div id="content">{run_content(view, base, ui_base, downloads)}</div>'
    )
    if not view.finished:
        body += REFRESH % refresh_ms
    return _doc(f"{view.dag_id} {view.run_id}", body)
