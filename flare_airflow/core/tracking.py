"""What a run reports to the experiment tracker, as plain data (no tracker client here).

The run's own tasks turn each round's summary (the aggregation's XCom) and the sites' update
records into metric points ``{key: {step: value}}`` with ``step = round``; the writer
(:mod:`flare_airflow.tracking`) logs the points a run does not hold yet, so a retried aggregation,
a resume or a re-run publish never logs a point twice. Trainers add their own scalars with the
Client API's ``log_metric``: they travel in the update record (``meta["tracked_metrics"]``) and
are written by the same task, never by the site.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

# The update record's meta key holding a trainer's own scalars: a list of [key, value, step].
TRACKED_META_KEY = "tracked_metrics"
# Per site and round: enough for a loss per batch of a long epoch; a record stays small.
MAX_TRACKED_POINTS = 10_000
# MLflow's metric key rule (letters, digits, _ - . / space and :), at most 250 characters.
METRIC_KEY = re.compile(r"^[A-Za-z0-9_\-./ :]{1,250}\Z")
MAX_STEP = 2**53

Points = dict[str, dict[int, float]]


def mlflow_run_url(ui: str | None, experiment_id: str, run_id: str) -> str | None:
    """A run's page in the MLflow UI served at ``ui`` (None: no UI)."""
    return f"{ui}/#/experiments/{quote(experiment_id, safe='')}/runs/{quote(run_id, safe='')}" if ui else None


def metric_key_problem(key: object) -> str | None:
    """Why ``key`` cannot name a tracked metric, else None."""
    if not isinstance(key, str):
        return f"a metric name must be a string, got {type(key).__name__}"
    if not METRIC_KEY.match(key):
        return (
            f"metric name {key[:60]!r} is not allowed: use letters, digits, '_', '-', '.', '/', ':' and spaces "
            "(at most 250 characters)"
        )
    return None


def finite_number(value: object) -> float | None:
    """``value`` as a finite float, or None (bools, strings, NaN and infinities are not metrics)."""
    # numbers.Real: numpy's scalars too; bool is an int but no metric, and a string is no number.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def tracked_points(meta: Mapping[str, Any]) -> tuple[Points, list[str]]:
    """A trainer's own scalars from an update record's meta, and what was left out and why.

    The record comes from the site, so every entry is checked again here.
    """
    raw = meta.get(TRACKED_META_KEY)
    points: Points = {}
    problems: list[str] = []
    if raw is None:
        return points, problems
    if not isinstance(raw, list):
        return points, [f"meta[{TRACKED_META_KEY!r}] is not a list"]
    for index, entry in enumerate(raw[:MAX_TRACKED_POINTS]):
        if not (isinstance(entry, list) and len(entry) == 3):
            problems.append(f"entry {index} is not [name, value, step]")
            continue
        key, value, step = entry
        number = finite_number(value)
        why = metric_key_problem(key)
        if why is None and number is None:
            why = f"{key!r}: value is not a finite number"
        if why is None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP):
            why = f"{key!r}: step must be an integer in 0..2**53"
        if why is not None:
            problems.append(why)
            continue
        assert number is not None
        points.setdefault(key, {})[step] = number
    if len(raw) > MAX_TRACKED_POINTS:
        problems.append(f"{len(raw) - MAX_TRACKED_POINTS} points beyond the first {MAX_TRACKED_POINTS}")
    return points, problems


def _numbers(values: Any, prefix: str = "") -> dict[str, float]:
    if not isinstance(values, Mapping):
        return {}
    found = {f"{prefix}{k}": finite_number(v) for k, v in values.items() if metric_key_problem(f"{prefix}{k}") is None}
    return {k: v for k, v in found.items() if v is not None}


def round_points(summary: Mapping[str, Any]) -> dict[str, float]:
    """The run-level points of one round (step = round) from its aggregation summary.

    ``global_<name>``: the evaluation of the round's global model (accuracy, loss, ...);
    ``mean_<name>``: the sample-weighted mean of the sites' metrics; ``sites_valid`` and
    ``sites_rejected``, ``num_samples``; and ``privacy_<name>`` (e.g. ε) where the round reports it.
    """
    points = {
        **_numbers(summary.get("evaluation"), "global_"),
        **_numbers(summary.get("metrics"), "mean_"),
        **_numbers(summary.get("privacy"), "privacy_"),
        "sites_valid": float(len(summary.get("accepted") or ())),
        "sites_rejected": float(len(summary.get("rejected") or {})),
    }
    samples = finite_number(summary.get("num_samples"))
    if samples is not None:
        points["num_samples"] = samples
    return points


def site_points(summary: Mapping[str, Any], site: str) -> dict[str, float]:
    """The points of one site in one round (step = round): the metrics its update carried."""
    per_site = summary.get("site_metrics")
    # Sealed (a string) in strict mode's XCom until the central side opens it: no points, no crash.
    return _numbers(per_site.get(site)) if isinstance(per_site, Mapping) else {}


def at_step(values: Mapping[str, float], step: int) -> Points:
    return {key: {step: value} for key, value in values.items()}


def merge_points(*parts: Points) -> Points:
    """One ``{key: {step: value}}`` from several; a later part wins at the same key and step."""
    merged: Points = {}
    for part in parts:
        for key, steps in part.items():
            merged.setdefault(key, {}).update(steps)
    return merged


def missing_points(wanted: Points, logged: Mapping[str, Mapping[int, float]]) -> tuple[Points, list[str]]:
    """The points of ``wanted`` not logged yet, and the ones logged with another value.

    A tracker keeps every point it was given, so a point is logged once per key and step: a round
    aggregated again (same updates, same model) finds its points there and logs nothing. A point
    logged with another value stays (the tracker cannot replace one) and is reported.
    """
    todo: Points = {}
    differ: list[str] = []
    for key, steps in wanted.items():
        have = logged.get(key, {})
        for step, value in steps.items():
            if step not in have:
                todo.setdefault(key, {})[step] = value
            elif not math.isclose(have[step], value, rel_tol=1e-9, abs_tol=1e-12):
                differ.append(f"{key} at step {step}: logged {have[step]!r}, now {value!r}")
    return todo, differ


def run_key(dag_id: str, run_id: str) -> str:
    """The tag value that finds a DAG run's tracked run again (hex: safe in any tracker's filter)."""
    return hashlib.sha256(f"{dag_id}\0{run_id}".encode()).hexdigest()[:32]


def flat_params(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as flat ``a.b`` string params (a tracker's params are flat strings)."""
    out: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{name}."))
        elif isinstance(value, list | tuple):
            out[name] = ",".join(map(str, value))[:6000]
        else:
            out[name] = str(value)[:6000]
    return out


def sorted_steps(points: Points) -> Iterable[tuple[str, int, float]]:
    for key in sorted(points):
        for step in sorted(points[key]):
            yield key, step, points[key][step]
