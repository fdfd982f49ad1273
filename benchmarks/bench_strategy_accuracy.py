"""What robustness costs without an attacker, and what it buys with one: the digits example.

    python benchmarks/bench_strategy_accuracy.py [--out results/strategy_accuracy.md]

The demo job's setting (``dags/digits.yaml``: 4 non-IID sites, Dirichlet alpha = 0.5, 5 rounds, 10
local epochs, lr 0.5, batch 16) run in one process: the example trainer's own ``train`` per site,
each round's updates written to a temporary store and aggregated by ``aggregate_from_store`` with
each strategy; the held-out accuracy of the global model after each round. Then the robustness
e2e test's setting (5 IID sites, alpha = 1000, one site sending ``global - 10 x update``). Seeds as
the trainer sets them, so the numbers are the e2e runs' (up to Airflow's own overhead, none here).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile
from typing import Any

import numpy as np

from flare_airflow.core.aggregation.engine import aggregate_from_store
from flare_airflow.core.aggregation.strategies import StepContext
from flare_airflow.core.config.aggregator import aggregator_spec
from flare_airflow.core.model import FLModel, write_artifact

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH_DIR = pathlib.Path(__file__).resolve().parent

STRATEGIES: list[dict[str, Any]] = [
    {"name": "fedavg"},
    {"name": "fedavgm", "eta": 1.0, "momentum": 0.5},
    {"name": "fedadam", "eta": 0.05},
    {"name": "fedyogi", "eta": 0.05},
    {"name": "fedadagrad", "eta": 0.05},
    {"name": "median"},
    {"name": "trimmed_mean", "beta": 0.2},
    {"name": "krum", "f": 0},
    {"name": "krum", "f": 0, "m": 2},
    {"name": "fedavg", "norm_bound": 5.0},
]


def trainer() -> Any:
    spec = importlib.util.spec_from_file_location("digits_trainer", REPO / "examples" / "digits" / "trainer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(agg: dict, sites: int, alpha: float, rounds: int, epochs: int, attacker: int | None = None) -> list[float]:
    t = trainer()
    x_train, x_test, y_train, y_test = t.load_split(0)
    shards = t.partition(y_train, sites, alpha, 0)
    strategy = aggregator_spec(agg).strategy()
    glob = {"weight": np.zeros((64, 10), np.float32), "bias": np.zeros(10, np.float32)}
    state: dict = {}
    accuracy = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(1, rounds + 1):
            updates = []
            for s in range(sites):
                x, y = x_train[shards[s]], y_train[shards[s]]
                w, b = t.train(
                    glob["weight"], glob["bias"], x, y, lr=0.5, epochs=epochs, batch_size=16, seed=r * 101 + s
                )
                params = {"weight": w, "bias": b}
                if s == attacker:
                    params = {k: glob[k] - 10 * (v - glob[k]) for k, v in params.items()}
                path = pathlib.Path(tmp) / f"r{r}-s{s}.safetensors"
                write_artifact(path, FLModel(params=params, meta={"num_samples": len(y)}))
                updates.append((f"site-{s + 1}", path, None))
            outcome, state = aggregate_from_store(
                strategy, glob, updates, min_clients=sites, state=state, context=StepContext("bench", "r", r)
            )
            glob = outcome.params
            accuracy.append(float(t.loss_and_accuracy(glob["weight"], glob["bias"], x_test, y_test)[1]))
    return accuracy


def label(agg: dict) -> str:
    params = ", ".join(f"{k}={v}" for k, v in agg.items() if k != "name")
    return f"{agg['name']}" + (f" ({params})" if params else "")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(BENCH_DIR / "results" / "strategy_accuracy.md"))
    args = p.parse_args(argv)
    lines = [
        "# Strategies on the digits example: accuracy of the global model after each round",
        "",
        "`python benchmarks/bench_strategy_accuracy.py` (see its docstring). Held-out accuracy (360 digits).",
        "",
        "## No attacker: the demo job (4 non-IID sites, Dirichlet alpha 0.5, 10 local epochs)",
        "",
        "| strategy | round 1 | round 2 | round 3 | round 4 | round 5 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for agg in STRATEGIES:
        acc = run(agg, 4, 0.5, 5, 10)
        lines.append(f"| {label(agg)} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "## One hostile site: 5 IID sites (alpha 1000, 40 local epochs), site-5 sends global - 10 x update",
        "",
        "| strategy | round 1 | round 2 |",
        "|---|---:|---:|",
    ]
    for agg in (
        {"name": "fedavg"},
        {"name": "median"},
        {"name": "trimmed_mean", "beta": 0.2},
        {"name": "krum", "f": 1},
    ):
        acc = run(agg, 5, 1000.0, 2, 40, attacker=4)
        lines.append(f"| {label(agg)} | " + " | ".join(f"{a:.3f}" for a in acc) + " |")
        print(lines[-1], flush=True)
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
