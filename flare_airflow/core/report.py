"""The per-round report of a run: one row per round, as JSON (metrics file) and as a text table."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from flare_airflow.core.errors import FlareAirflowError, ReportError
from flare_airflow.core.store import path_from_uri

TRAIN_LOSS_KEYS = ("train_loss", "loss")


def round_row(summary: Mapping[str, Any], num_sites: int) -> dict[str, Any]:
    """One report row from an aggregation task's summary."""
    metrics = summary.get("metrics", {})
    loss = next((metrics[k] for k in TRAIN_LOSS_KEYS if k in metrics), None)
    return {
        "round": summary["round"],
        "sites_valid": len(summary.get("accepted", [])),
        "sites_total": num_sites,
        "accepted": list(summary.get("accepted", [])),
        "rejected": dict(summary.get("rejected", {})),
        "num_samples": summary.get("num_samples"),
        "train_loss": loss,
        # Sealed (a string) when the summary comes from strict mode's XCom unopened: none shown.
        "site_metrics": dict(site_metrics) if isinstance(site_metrics := summary.get("site_metrics"), Mapping) else {},
        "evaluation": dict(summary.get("evaluation", {})),
        "global_uri": summary.get("global_uri"),
        "sha256": summary.get("sha256"),
        # The run's (ε, δ) after this round (docs/privacy.md), None when the job adds no noise.
        "epsilon": (summary.get("privacy") or {}).get("epsilon"),
        # The distinct releases that ε is composed over (the most any site made; >= the round).
        "releases": (summary.get("privacy") or {}).get("releases"),
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table: round, valid sites, mean training loss, global evaluation metrics."""
    eval_keys = sorted({k for row in rows for k in row.get("evaluation", {})})
    eval_keys.sort(key=lambda k: (k != "accuracy", k))
    private = any(row.get("epsilon") is not None for row in rows)
    header = ["round", "valid sites", "mean train loss", *(f"global {k}" for k in eval_keys), *(["ε"] * private)]
    body = [
        [
            str(row["round"]),
            f"{row['sites_valid']}/{row['sites_total']}",
            _fmt(row.get("train_loss")),
            *(_fmt(row.get("evaluation", {}).get(k)) for k in eval_keys),
            *([_fmt(row.get("epsilon"))] * private),
        ]
        for row in rows
    ]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = [
        " | ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
        "-+-".join("-" * w for w in widths),
    ]
    lines += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    for row in rows:
        for site, reason in sorted(row.get("rejected", {}).items()):
            lines.append(f"  round {row['round']}: {site} did not count: {reason}")
    return "\n".join(lines)


MAX_METRICS_BYTES = 64 * 1024 * 1024


def _check_row(row: Any, index: int, where: str) -> None:
    if not isinstance(row, Mapping):
        raise ReportError(f"{where}: rounds[{index}] must be an object, got {type(row).__name__}")
    missing = [k for k in ("round", "sites_valid", "sites_total") if k not in row]
    if missing:
        raise ReportError(
            f"{where}: rounds[{index}] lacks {', '.join(missing)}; is this a metrics.json of flare-airflow?"
        )
    for key in ("evaluation", "rejected"):
        if not isinstance(row.get(key, {}), Mapping):
            raise ReportError(f"{where}: rounds[{index}].{key} must be an object, got {type(row[key]).__name__}")


def read_metrics(location: Any) -> list[dict[str, Any]]:
    """The rounds of a run's ``metrics.json`` (written by the publish task), checked for shape.

    ``location``: a path, a ``file://`` URI or an object store path. Raises :class:`ReportError`
    saying what is wrong with the file (unreadable, empty, too large, not JSON, another file).
    """
    where = str(location)
    try:
        path = path_from_uri(location) if isinstance(location, str) else location
        with path.open("rb") as fh:
            raw = fh.read(MAX_METRICS_BYTES + 1)
    except FlareAirflowError as exc:
        raise ReportError(str(exc)) from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ReportError(
            f"{where}: cannot read it ({reason}); give the metrics.json of a run "
            "(<store>/<job>/<run>/final/metrics.json, printed by `flare-airflow run`)"
        ) from None
    if len(raw) > MAX_METRICS_BYTES:
        raise ReportError(f"{where}: larger than {MAX_METRICS_BYTES // 2**20} MiB; not a metrics.json of flare-airflow")
    if not raw.strip():
        raise ReportError(f"{where}: the file is empty; the run that wrote it may have been interrupted")
    try:
        report = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ReportError(f"{where}: not JSON ({str(exc)[:120]}); give a run's metrics.json") from None
    if not isinstance(report, Mapping) or not isinstance(report.get("rounds"), list):
        got = type(report).__name__ if not isinstance(report, Mapping) else f"keys {', '.join(map(str, report))[:80]}"
        raise ReportError(
            f"{where}: not a metrics.json of flare-airflow (expected an object with a 'rounds' list; got {got})"
        )
    for index, row in enumerate(report["rounds"]):
        _check_row(row, index, where)
    return [dict(row) for row in report["rounds"]]
