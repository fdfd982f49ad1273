"""The Client API for trainer scripts (NVFlare-style ``receive()`` / ``send()``).

Needs only numpy and safetensors, so it runs in a site image without Airflow. Whatever launched
the script (a local process, a pod, a SLURM job) passes the same environment variables:

=========================  ===========================================================
``FLARE_JOB``              job name
``FLARE_RUN_ID``           Airflow run id
``FLARE_SITE``             this site's name
``FLARE_ROUND``            current round (1-based)
``FLARE_TOTAL_ROUNDS``     rounds in this run
``FLARE_TASK``             ``train`` or ``evaluate``
``FLARE_GLOBAL_MODEL``     path or URI of the global model to start from
``FLARE_OUTPUT``           path or URI where ``send()`` writes the update
``FLARE_HPARAMS``          JSON object of trainer hyper-parameters
``FLARE_GLOBAL_SHA256``    (optional) sha256 the global model must have; ``receive()`` checks it
=========================  ===========================================================

Example::

    import flare_airflow.client as flare

    model = flare.receive()
    new_params, n, loss = train(model.params, **flare.get_hparams())
    flare.send(flare.FLModel(params=new_params, metrics={"loss": loss}, meta={"num_samples": n}))

``log_metric(name, value, step)`` records a scalar of your own (a loss per epoch, say); it
travels with the update sent and reaches the run's experiment tracker in the site's child run
(docs/tracking.md). The site itself never talks to the tracker.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from flare_airflow.core.aggregation.strategies.fedprox import FEDPROX_MU_HPARAM, proximal_gradient, proximal_term
from flare_airflow.core.envvars import (
    CLIENT_API_VARS,
    FLARE_GLOBAL_MODEL,
    FLARE_GLOBAL_SHA256,
    FLARE_HANDSHAKE,
    FLARE_HPARAMS,
    FLARE_JOB,
    FLARE_LORA,
    FLARE_OUTPUT,
    FLARE_ROUND,
    FLARE_RUN_ID,
    FLARE_SITE,
    FLARE_TASK,
    FLARE_TOTAL_ROUNDS,
)
from flare_airflow.core.errors import ClientAPIError, FlareAirflowError
from flare_airflow.core.model import FLModel, ParamsType, read_artifact, write_artifact
from flare_airflow.core.store import path_from_uri
from flare_airflow.core.tracking import (
    MAX_STEP,
    MAX_TRACKED_POINTS,
    TRACKED_META_KEY,
    finite_number,
    metric_key_problem,
)

__all__ = [
    "ENV_VARS",
    "FLModel",
    "ParamsType",
    "get_fedprox_mu",
    "get_hparams",
    "get_job_info",
    "get_lora",
    "get_round",
    "get_site_name",
    "get_total_rounds",
    "init",
    "is_evaluate",
    "is_train",
    "log_metric",
    "proximal_gradient",
    "proximal_term",
    "receive",
    "send",
]

ENV_VARS = CLIENT_API_VARS
TASK_TRAIN = "train"
TASK_EVALUATE = "evaluate"


class _Session:
    def __init__(self) -> None:
        self.received: FLModel | None = None
        self.sent = False
        # (name, step) -> value: one value per name and step, the last call wins.
        self.tracked: dict[tuple[str, int], float] = {}


_session = _Session()


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ClientAPIError(
            f"environment variable {name} is not set: this script must be launched by flare-airflow "
            "(a site task), or set the FLARE_* variables yourself to run it by hand"
        )
    return value


def init() -> None:
    """Check that the launch environment is complete (optional; ``receive()`` checks too)."""
    for name in ENV_VARS:
        if name != FLARE_HPARAMS:
            _env(name)


def get_site_name() -> str:
    return _env(FLARE_SITE)


def get_round() -> int:
    return int(_env(FLARE_ROUND))


def get_total_rounds() -> int:
    return int(_env(FLARE_TOTAL_ROUNDS))


def get_job_info() -> dict[str, Any]:
    return {"job": _env(FLARE_JOB), "run_id": _env(FLARE_RUN_ID), "site": get_site_name(), "round": get_round()}


def is_train() -> bool:
    return _env(FLARE_TASK) == TASK_TRAIN


def is_evaluate() -> bool:
    return _env(FLARE_TASK) == TASK_EVALUATE


def get_hparams() -> dict[str, Any]:
    raw = os.environ.get(FLARE_HPARAMS) or "{}"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ClientAPIError(f"FLARE_HPARAMS is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ClientAPIError("FLARE_HPARAMS must be a JSON object")
    return value


def get_fedprox_mu() -> float:
    """FedProx's ``mu`` for this run (``aggregator: {name: fedprox, mu: ...}``), 0.0 when the job does
    not use FedProx: add ``proximal_term(params, global_params, mu)`` to the local loss (its gradient:
    ``proximal_gradient``)."""
    value = get_hparams().get(FEDPROX_MU_HPARAM, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ClientAPIError(f"FLARE_HPARAMS: {FEDPROX_MU_HPARAM} must be a number >= 0, got {value!r}")
    return float(value)


def get_lora() -> dict[str, Any] | None:
    """A LoRA job's block (``FLARE_LORA``): ``base_model`` (this site's copy, its sha256 checked by
    the site before the launch), ``target_modules``, ``rank``, ``alpha``, ``seq_len``,
    ``steps_per_round``, and ``frozen``: glob patterns of the adapter tensors to leave as received
    (FFA-LoRA's A matrices). ``None`` for a job without ``lora`` (docs/llm.md)."""
    raw = os.environ.get(FLARE_LORA)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ClientAPIError(f"{FLARE_LORA} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ClientAPIError(f"{FLARE_LORA} must be a JSON object")
    return value


def receive() -> FLModel:
    """Return the global model for this round (params as named numpy arrays)."""
    init()
    handshake = os.environ.get(FLARE_HANDSHAKE)
    if handshake:
        # Tells the launcher the trainer started and reached the Client API (launch_timeout).
        with open(handshake, "a"):
            pass
    path = path_from_uri(_env(FLARE_GLOBAL_MODEL))
    try:
        params, record = read_artifact(path)
    except FlareAirflowError as exc:
        raise ClientAPIError(f"cannot read the global model: {exc}") from exc
    expected = os.environ.get(FLARE_GLOBAL_SHA256)
    if expected and record.sha256 != expected:
        raise ClientAPIError(
            f"the global model {path} is not the one this round was given (sha256 {record.sha256[:12]}…, "
            f"expected {expected[:12]}…): it was replaced after it was published; re-run the round"
        )
    model = FLModel(
        params=params,
        params_type=ParamsType.FULL,
        metrics=dict(record.metrics),
        meta={"job": _env(FLARE_JOB), "run_id": _env(FLARE_RUN_ID), "task": _env(FLARE_TASK)},
        current_round=get_round(),
        total_rounds=get_total_rounds(),
        site=get_site_name(),
    )
    _session.received = model
    _session.sent = False
    _session.tracked = {}
    return model


def log_metric(name: str, value: float, step: int | None = None) -> None:
    """Record a scalar of this site's training (e.g. the loss of each epoch) for the experiment tracker.

    It is sent with this round's update by ``send()`` and written to the site's run in the tracker
    by the round's aggregation (no tracker access from the site). ``step`` defaults to the round;
    give your own (``(round - 1) * epochs + epoch``) for a series within a round. One value per
    name and step: logging the same name and step again replaces the value.
    """
    why = metric_key_problem(name)
    if why is not None:
        raise ClientAPIError(f"log_metric: {why}")
    number = finite_number(value)
    if number is None:
        raise ClientAPIError(f"log_metric({name!r}): the value must be a finite number, got {str(value)[:40]!r}")
    if step is None:
        step = get_round()
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ClientAPIError(f"log_metric({name!r}): step must be an integer in 0..2**53, got {str(step)[:40]!r}")
    if len(_session.tracked) >= MAX_TRACKED_POINTS and (name, step) not in _session.tracked:
        raise ClientAPIError(
            f"log_metric: more than {MAX_TRACKED_POINTS} points in one round; log fewer (e.g. per epoch, not per batch)"
        )
    _session.tracked[(name, step)] = number


def send(model: FLModel) -> None:
    """Write this site's result: an update (train) or metrics (evaluate). Call once per receive().

    In a site job of several ranks (``RANK`` set, as torchrun and flare-airflow's multi-node SLURM
    jobs set it) only rank 0 writes; the other ranks' ``send()`` returns without writing.
    """
    if _session.received is None:
        raise ClientAPIError("send() called before receive(): receive the global model first")
    if _session.sent:
        raise ClientAPIError("send() called twice for one receive(); a site sends one update per round")
    if not isinstance(model, FLModel):
        raise ClientAPIError(f"send() takes an FLModel, got {type(model).__name__}")
    if is_train() and not model.params:
        raise ClientAPIError("send() in a train task needs params (the updated weights or their DIFF)")
    if os.environ.get("RANK", "0") not in ("", "0"):
        # A multi-rank site job (SLURM nodes / tasks_per_node > 1): the site's one update is rank 0's.
        _session.sent = True
        return
    if _session.tracked:
        tracked = [[name, value, step] for (name, step), value in sorted(_session.tracked.items())]
        model = dataclasses.replace(model, meta={**model.meta, TRACKED_META_KEY: tracked})
    out = path_from_uri(_env(FLARE_OUTPUT))
    write_artifact(out, model, where=f"update from site {get_site_name()} round {get_round()}")
    _session.sent = True
