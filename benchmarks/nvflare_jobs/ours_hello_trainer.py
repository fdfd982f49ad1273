"""flare-airflow trainer of the hello-numpy-style job: add 1 to the model, send it back.

The same work as ``hello_client.py`` does under NVFlare, through flare-airflow's Client API.
"""

from __future__ import annotations

import flare_airflow.client as flare


def main() -> int:
    model = flare.receive()
    if flare.is_evaluate():
        flare.send(flare.FLModel(metrics={"loss": 0.0}))
        return 0
    flare.send(flare.FLModel(params={k: v + 1 for k, v in model.params.items()}, metrics={"loss": 0.0}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
