"""Trainer of the Kubernetes API-cost benchmark: receive the global model, sleep, send it back.

Client API only (``receive()``, ``time.sleep(--seconds)``, ``send()``), so a site pod lives for a
known time and ends with a real update; what the benchmark counts is what the Airflow side asks
the API server while it waits.
"""

from __future__ import annotations

import argparse
import time

import flare_airflow.client as flare


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, required=True, help="how long the 'training' takes")
    args = parser.parse_args()
    model = flare.receive()
    print(f"received the global model; sleeping {args.seconds:g} s", flush=True)
    time.sleep(args.seconds)
    flare.send(flare.FLModel(params=model.params, meta={"num_samples": 10}))
    print("update sent", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
