"""NVFlare client of the hello-numpy-style job (NVFlare's Client API): add 1 to the model, send it back.

Runs inside NVFlare's simulator, in NVFlare's own virtual environment (never the project's).
"""

from __future__ import annotations

import nvflare.client as flare
from nvflare.app_common.np.constants import NPConstants


def main() -> None:
    flare.init()
    while flare.is_running():
        model = flare.receive()
        if model is None:  # the job is ending
            break
        weights = model.params[NPConstants.NUMPY_KEY]
        flare.send(
            flare.FLModel(
                params={NPConstants.NUMPY_KEY: weights + 1},
                metrics={"loss": 0.0},
                current_round=model.current_round,
            )
        )


if __name__ == "__main__":
    main()
