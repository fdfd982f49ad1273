"""An NVFlare 2.9 Client API script in hello-numpy's shape, run unmodified by NVFlare and flare-airflow.

Each site adds its own step (site-1: 1, site-2: 3, site-3: 5, ...) to the model and reports the
step as the update's weight (NUM_STEPS_CURRENT_ROUND), so that the weighted average says whose
update counted how much: with two sites each round adds (1*1 + 3*3) / 4 = 2.5. Every number is a
small multiple of 1/2: float32 arithmetic is exact, and so must be the comparison.
"""

import nvflare.client as flare
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.np.constants import NPConstants
from nvflare.client.tracking import SummaryWriter


def main():
    flare.init()
    site = flare.get_site_name()
    step = 2 * int(site.rsplit("-", 1)[-1]) - 1
    writer = SummaryWriter()
    while flare.is_running():
        model = flare.receive()
        if model is None:
            break
        weights = model.params[NPConstants.NUMPY_KEY]
        writer.add_scalar("step", step, model.current_round)
        flare.send(
            flare.FLModel(
                params={NPConstants.NUMPY_KEY: weights + step},
                metrics={"round": model.current_round},
                meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: step},
            )
        )


if __name__ == "__main__":
    main()
