"""A no-op-ish trainer for the end-to-end benchmark: receive the global model, send it back.

It exercises the whole Client API path (read + verify the global model, write the update with its
record) and nothing else, so what the benchmark measures is orchestration overhead, not training.
"""

from __future__ import annotations

import flare_airflow.client as flare


def main() -> int:
    model = flare.receive()
    if flare.is_evaluate():
        flare.send(flare.FLModel(metrics={"loss": 0.0}))
        return 0
    flare.send(flare.FLModel(params=model.params, metrics={"loss": 0.0}, meta={"num_samples": 10}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
