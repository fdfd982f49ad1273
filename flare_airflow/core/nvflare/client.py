"""NVFlare 2.9's Client API (``import nvflare.client as flare``) on flare-airflow's Client API.

An NVFlare script runs once for a whole job and loops ``while flare.is_running()`` over its
rounds. Under flare-airflow a trainer process is one site job: one round at one site. So here
``is_running()`` is true until the site job's one ``send()``, then false; ``receive()`` after that
send returns ``None``, as NVFlare's does when the job ends. The script's loop runs once per
process, and what it kept in memory across rounds starts afresh (see :mod:`.state_check`).

What maps onto what:

=================================  ==============================================================
NVFlare                            flare-airflow
=================================  ==============================================================
``FLModel.current_round``          ``FLARE_ROUND - 1`` (NVFlare counts from 0)
``FLModel.total_rounds``           ``FLARE_TOTAL_ROUNDS``
``meta["NUM_STEPS_CURRENT_ROUND"]``  the update's ``num_samples`` (the FedAvg weight; default 1)
``params_type`` FULL / DIFF        the update's params type; with the job's transfer type
                                   ``DIFF`` a FULL update is sent as its difference to the
                                   received model (as NVFlare's Client API does)
``metrics`` + ``tracking`` scalars the update's metrics (the last value of each tag; the
                                   script's own ``metrics`` win)
torch tensors in ``params``        numpy arrays on the wire (safetensors, bit-exact); received
                                   as torch tensors when the job's params exchange is ``pytorch``
``system_info()``                  ``{"site_name": FLARE_SITE, "job_id": FLARE_RUN_ID}``
``is_train()`` / ``is_evaluate()``  ``FLARE_TASK`` is ``train`` / ``evaluate``
``is_submit_model()``              always false (no cross-site model submission)
=================================  ==============================================================

Contract errors are raised as NVFlare raises them (``RuntimeError``, NVFlare's message): a call
before ``init()``, ``send()`` before ``receive()``, a second ``send()``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from flare_airflow.core import client as native
from flare_airflow.core.envvars import FLARE_NVFLARE_PARAMS_EXCHANGE, FLARE_NVFLARE_TRANSFER
from flare_airflow.core.errors import ClientAPIError
from flare_airflow.core.model import FLModel as NativeModel
from flare_airflow.core.model import ParamsType as NativeParamsType
from flare_airflow.core.nvflare.convert import diff_from, scalar, scalars, to_numpy, to_torch, update_meta
from flare_airflow.core.nvflare.fl_model import (
    NOT_AN_FLMODEL,
    NOT_INITIALIZED,
    NOTHING_TO_SEND,
    SEND_BEFORE_RECEIVE,
    AnalyticsDataType,
    FLMetaKey,
    FLModel,
    NVFlareContractError,
    NVFlareTypeError,
    ParamsType,
)

__all__ = [
    "AnalyticsDataType",
    "FLMetaKey",
    "FLModel",
    "NVFlareContractError",
    "NVFlareTypeError",
    "ParamsType",
    "clear",
    "get_config",
    "get_job_id",
    "get_site_name",
    "get_task_name",
    "init",
    "is_evaluate",
    "is_running",
    "is_submit_model",
    "is_train",
    "log",
    "receive",
    "send",
    "shutdown",
    "system_info",
    "use_model_classes",
]

EXCHANGE_NUMPY = "numpy"
EXCHANGE_PYTORCH = "pytorch"
EXCHANGES = (EXCHANGE_NUMPY, EXCHANGE_PYTORCH)
TRANSFERS = ("FULL", "DIFF")
# NVFlare's default task names (the executor's train_task_name / evaluate_task_name).
TRAIN_TASK = "train"
EVALUATE_TASK = "validate"
SUBMIT_MODEL_TASK = "submit_model"


class _ModelClasses:
    """The ``FLModel`` / ``ParamsType`` that ``receive()`` builds: these, or a real nvflare's."""

    model: Any = None
    params_type: Any = None


_classes = _ModelClasses()


def use_model_classes(model: type, params_type: type) -> None:
    """Build received models with ``model`` / ``params_type`` (the stand-in passes a real nvflare's)."""
    _classes.model, _classes.params_type = model, params_type


class _Session:
    """One trainer process = one site job: at most one receive and one send."""

    def __init__(self) -> None:
        self.initialized = False
        self.received: NativeModel | None = None  # the global model as numpy, for DIFF
        self.given: Any = None  # the FLModel receive() returned (returned again until the send)
        self.sent = False
        self.scalars: dict[str, float] = {}


_session = _Session()


def _initialized() -> None:
    if not _session.initialized:
        raise NVFlareContractError(NOT_INITIALIZED)


def _exchange() -> str:
    value = os.environ.get(FLARE_NVFLARE_PARAMS_EXCHANGE) or EXCHANGE_NUMPY
    if value not in EXCHANGES:
        raise ClientAPIError(f"{FLARE_NVFLARE_PARAMS_EXCHANGE}={value!r}: expected one of {', '.join(EXCHANGES)}")
    return value


def _transfer() -> str:
    value = (os.environ.get(FLARE_NVFLARE_TRANSFER) or "FULL").upper()
    if value not in TRANSFERS:
        raise ClientAPIError(f"{FLARE_NVFLARE_TRANSFER}={value!r}: expected FULL or DIFF")
    return value


def init(rank: int | str | None = None, config_file: str | None = None) -> None:
    """Check the launch environment (the ``FLARE_*`` variables). A second call is ignored, as in NVFlare.

    ``rank`` and ``config_file`` are accepted for NVFlare's signature; the rank comes from ``RANK``
    (as flare-airflow's multi-rank jobs set it) and there is no config file to read.
    """
    if _session.initialized:
        return
    native.init()
    _exchange()
    _transfer()
    _session.initialized = True


def is_running() -> bool:
    """True until this site job's one ``send()``: one round per process."""
    _initialized()
    return not _session.sent


def receive(timeout: float | None = None) -> Any:
    """The round's global model (the same object until the send); ``None`` after the send (job ends)."""
    _initialized()
    if _session.sent:
        return None
    if _session.given is not None:
        return _session.given
    model = native.receive()
    params: dict[str, Any] = dict(model.params)
    if _exchange() == EXCHANGE_PYTORCH:
        params = to_torch(params)
    round_0 = (model.current_round or 1) - 1
    meta = {
        FLMetaKey.CURRENT_ROUND: round_0,
        FLMetaKey.TOTAL_ROUNDS: model.total_rounds,
        FLMetaKey.JOB_ID: native.get_job_info()["run_id"],
        FLMetaKey.SITE_NAME: native.get_site_name(),
    }
    model_class = _classes.model or FLModel
    params_type_class = _classes.params_type or ParamsType
    given = model_class(
        params_type=params_type_class("FULL"),
        params=params,
        metrics=dict(model.metrics) or None,
        current_round=round_0,
        total_rounds=model.total_rounds,
        meta=meta,
    )
    _session.received = model
    _session.given = given
    return given


def send(model: Any, clear_cache: bool = True) -> None:
    """Send this site job's one result: an update (train) or metrics (evaluate)."""
    if not isinstance(model, FLModel | (_classes.model or FLModel)):
        raise NVFlareTypeError(
            f"{NOT_AN_FLMODEL} (got {type(model).__name__}): build it as flare.FLModel(params=..., metrics=...)"
        )
    _initialized()
    if _session.given is None or _session.sent:
        # NVFlare clears its received task after a send: a second send fails the same way.
        raise NVFlareContractError(SEND_BEFORE_RECEIVE)
    if model.params is None and model.metrics is None:
        raise NVFlareContractError(NOTHING_TO_SEND)
    assert _session.received is not None  # set together with _session.given
    params = to_numpy(model.params or {}, "params")
    # Ours or a real nvflare's ParamsType: compared by value.
    sent_type = ParamsType(getattr(model.params_type, "value", model.params_type) or "FULL")
    params_type = sent_type
    # NVFlare's DIFF transfer turns a FULL model into its difference to the model received.
    if params and model.params_type is not None and sent_type is ParamsType.FULL and _transfer() == "DIFF":
        params = diff_from(params, _session.received.params)
        params_type = ParamsType.DIFF
    if model.optimizer_params:
        print(
            "nvflare.client (flare-airflow): optimizer_params are not sent; FedAvg aggregates params only",
            file=sys.stderr,
            flush=True,
        )
    meta = update_meta(model.meta or {})
    metrics = {**_session.scalars, **scalars(model.metrics or {})}
    native.send(NativeModel(params=params, params_type=NativeParamsType(params_type.value), metrics=metrics, meta=meta))
    _session.sent = True


def system_info() -> dict[str, Any]:
    _initialized()
    return {FLMetaKey.SITE_NAME: native.get_site_name(), FLMetaKey.JOB_ID: native.get_job_info()["run_id"]}


def get_site_name() -> str:
    _initialized()
    return native.get_site_name()


def get_job_id() -> str:
    _initialized()
    return str(native.get_job_info()["run_id"])


def get_task_name() -> str:
    _initialized()
    return TRAIN_TASK if native.is_train() else EVALUATE_TASK


def get_config() -> dict[str, Any]:
    """What NVFlare's client config would say about this site job's exchange."""
    _initialized()
    return {
        "TASK_EXCHANGE": {
            "train_task_name": TRAIN_TASK,
            "eval_task_name": EVALUATE_TASK,
            "submit_model_task_name": SUBMIT_MODEL_TASK,
            "exchange_format": _exchange(),
            "transfer_type": _transfer(),
        },
        "SITE_NAME": native.get_site_name(),
        "JOB_ID": get_job_id(),
    }


def is_train() -> bool:
    _initialized()
    return native.is_train()


def is_evaluate() -> bool:
    _initialized()
    return native.is_evaluate()


def is_submit_model() -> bool:
    _initialized()
    return False


def log(key: str, value: Any, data_type: AnalyticsDataType | str, **kwargs: Any) -> None:
    """Tracking: scalars and metrics land in the round's metrics (the last value of each key)."""
    _initialized()
    kind = AnalyticsDataType(getattr(data_type, "value", data_type))  # ours, a real nvflare's, or its value
    if kind in (AnalyticsDataType.SCALAR, AnalyticsDataType.METRIC):
        _session.scalars[key] = scalar(value, key)
    elif kind in (AnalyticsDataType.SCALARS, AnalyticsDataType.METRICS):
        if not isinstance(value, Mapping):
            raise ClientAPIError(f"log({key!r}, ...): {kind.value} takes a dict of numbers, got {type(value).__name__}")
        prefix = f"{key}/" if kind is AnalyticsDataType.SCALARS else ""
        for name, item in value.items():
            _session.scalars[f"{prefix}{name}"] = scalar(item, f"{prefix}{name}")
    # Text, images and parameters have no place in a round's metrics; they are not kept.


def clear() -> None:
    """NVFlare drops its cached task; here the one site job's state stays until the process ends."""


def shutdown() -> None:
    """Nothing to stop: no agent, no pipe."""
