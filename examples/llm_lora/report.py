"""The LoRA demo's per-site table and plot: held-out loss of the base model and of the global adapter
after each round, per site, from the run's metrics file (``flare-airflow run ... --json`` output).

Usage: ``python examples/llm_lora/report.py RUN.json`` (what ``make llm-demo`` runs). Writes
``llm_losses.png`` next to the run's metrics file and prints the table.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

from flare_airflow.core.report import read_metrics


def site_losses(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """site -> {"base": loss, "round 1": loss, ...} from the evaluation of every round's global adapter."""
    table: dict[str, dict[str, float]] = {}
    for row in rows:
        for key, value in row.get("evaluation", {}).items():
            kind, _, site = key.partition("/")
            if kind == "base_loss":
                table.setdefault(site, {})["base"] = value
            elif kind == "heldout_loss":
                table.setdefault(site, {})[f"round {row['round']}"] = value
    return table


def main(argv: list[str]) -> int:
    state = json.loads(pathlib.Path(argv[0]).read_text())
    published = state.get("published") or {}
    if not published:
        print(f"run {state.get('run_id')} published nothing (state {state.get('state')})", file=sys.stderr)
        return 1
    metrics_uri = published["metrics"]
    rows = read_metrics(metrics_uri)
    table = site_losses(rows)
    columns = ["base", *(f"round {row['round']}" for row in rows)]
    print(f"\nheld-out loss per site (lower is better), run {state['run_id']}, {state.get('wall_seconds')} s:")
    print(f"{'site':<8}" + "".join(f"{c:>10}" for c in columns) + f"{'change':>10}")
    for site, losses in sorted(table.items()):
        cells = "".join(f"{losses[c]:>10.4f}" if c in losses else f"{'-':>10}" for c in columns)
        change = losses.get(columns[-1], float("nan")) - losses.get("base", float("nan"))
        print(f"{site:<8}{cells}{change:>+10.4f}")
    sizes = [row.get("site_metrics", {}) for row in rows]
    print(f"rounds: {len(rows)}; sites counted per round: {[len(s) for s in sizes]}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for site, losses in sorted(table.items()):
        xs = [i for i, c in enumerate(columns) if c in losses]
        ax.plot(xs, [losses[columns[i]] for i in xs], marker="o", label=site)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_ylabel("held-out loss")
    ax.set_title("Federated LoRA (FFA-LoRA) on SmolLM2-135M")
    ax.legend()
    plot = pathlib.Path(str(metrics_uri).removeprefix("file://")).with_name("llm_losses.png")
    fig.tight_layout()
    fig.savefig(plot)
    print(f"plot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
