"""The digits example trainer, with one hostile site: it trains like the others, then sends its
update sign-flipped and scaled x10 (``global - 10 * (trained - global)``), every round.

    digits_attacker.py ATTACKER_SITE [the digits trainer's arguments...]
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys

import flare_airflow.client as flare

TRAINER = pathlib.Path(__file__).resolve().parents[3] / "examples" / "digits" / "trainer.py"

attacker, *rest = sys.argv[1:]
sys.argv = [str(TRAINER), *rest]
if os.environ.get("FLARE_SITE") == attacker and flare.is_train():
    real_receive, real_send = flare.receive, flare.send
    received: dict = {}

    def receive() -> flare.FLModel:
        model = real_receive()
        received.update({k: v.copy() for k, v in model.params.items()})
        return model

    def send(model: flare.FLModel) -> None:
        model.params = {k: received[k] - 10 * (v - received[k]) for k, v in model.params.items()}
        real_send(model)

    flare.receive, flare.send = receive, send  # the trainer calls flare.receive() / flare.send()
runpy.run_path(str(TRAINER), run_name="__main__")
