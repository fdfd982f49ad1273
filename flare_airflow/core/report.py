"""The per-round report of a run: one row per round, as JSON (metrics file) and as a text table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
        "site_metrics": dict(summary.get("site_metrics", {})),
        "evaluation": dict(summary.get("evaluation", {})),
        "global_uri": summary.get("global_uri"),
        "sha256": summary.get("sha256"),
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
    header = ["round", "valid sites", "mean train loss", *(f"global {k}" for k in eval_keys)]
    body = [
        [
            str(row["round"]),
            f"{row['sites_valid']}/{row['sites_total']}",
            _fmt(row.get("train_loss")),
            *(_fmt(row.get("evaluation", {}).get(k)) for k in eval_keys),
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
