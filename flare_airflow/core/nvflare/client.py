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

import enum
import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from flare_airflow.core import client as native
from flare_airflow.core.envvars import FLARE_NVFLARE_PARAMS_EXCHANGE, FLARE_NVFLARE_TRANSFER
from flare_airflow.core.errors import ClientAPIError
from flare_airflow.core.model import FLModel as NativeModel
from flare_airflow.core.model import ParamsType as NativeParamsType

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

NOT_INITIALIZED = "APIContext is None. Did you call flare.init() before using the Client API?"
SEND_BEFORE_RECEIVE = '"receive" needs to be called before sending model!'
NOTHING_TO_SEND = "the model to send does not have either params or metrics"
NOT_AN_FLMODEL = "model needs to be an instance of FLModel"


class NVFlareContractError(ClientAPIError, RuntimeError):
    """A Client API call out of order; a ``RuntimeError`` with NVFlare's own message, as NVFlare raises it."""


class NVFlareTypeError(ClientAPIError, TypeError):
    """``send()`` of something that is not an ``FLModel``: a ``TypeError``, as NVFlare raises it."""


class ParamsType(enum.StrEnum):
    """NVFlare's ``nvflare.app_common.abstract.fl_model.ParamsType``."""

    FULL = "FULL"
    DIFF = "DIFF"


class FLMetaKey:
    """NVFlare 2.9's ``nvflare.apis.fl_constant.FLMetaKey``: the same names and values."""

    NUM_STEPS_CURRENT_ROUND = "NUM_STEPS_CURRENT_ROUND"
    PROCESSED_ALGORITHM = "PROCESSED_ALGORITHM"
    PROCESSED_KEYS = "PROCESSED_KEYS"
    INITIAL_METRICS = "initial_metrics"
    FILTER_HISTORY = "filter_history"
    CONFIGS = "configs"
    VALIDATE_TYPE = "validate_type"
    START_ROUND = "start_round"
    CURRENT_ROUND = "current_round"
    TOTAL_ROUNDS = "total_rounds"
    JOB_ID = "job_id"
    SITE_NAME = "site_name"
    PROCESS_RC_FILE = "_process_rc.txt"
    SUBMIT_MODEL_NAME = "submit_model_name"
    AUTH_TOKEN = "auth_token"  # noqa: S105 - the name of a meta key, not a secret
    AUTH_TOKEN_SIGNATURE = "auth_token_signature"  # noqa: S105 - likewise


class AnalyticsDataType(enum.StrEnum):
    """NVFlare's ``nvflare.apis.analytix.AnalyticsDataType`` (what ``log()`` is told it gets)."""

    SCALARS = "SCALARS"
    SCALAR = "SCALAR"
    IMAGE = "IMAGE"
    TEXT = "TEXT"
    LOG_RECORD = "LOG_RECORD"
    PARAMETER = "PARAMETER"
    PARAMETERS = "PARAMETERS"
    METRIC = "METRIC"
    METRICS = "METRICS"
    MODEL = "MODEL"
    TAG = "TAG"
    TAGS = "TAGS"
    INIT_DATA = "INIT_DATA"


class FLModel:
    """NVFlare's ``FLModel``: the same constructor, the same attributes."""

    def __init__(
        self,
        params_type: ParamsType | str | None = None,
        params: Any = None,
        optimizer_params: Any = None,
        metrics: dict[str, Any] | None = None,
        start_round: int | None = 0,
        current_round: int | None = None,
        total_rounds: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        # As NVFlare's: params without a type are FULL; a FULL or DIFF model must have params.
        if params_type is None:
            self.params_type = ParamsType.FULL if params is not None else None
        else:
            self.params_type = ParamsType(params_type)
            if params is None:
                raise ValueError(f"params must be provided when params_type is {self.params_type}")
        self.params = params
        self.optimizer_params = optimizer_params
        self.metrics = metrics
        self.start_round = start_round
        self.current_round = current_round
        self.total_rounds = total_rounds
        self.meta = {} if meta is None else meta

    def summary(self) -> dict[str, Any]:
        return {
            "params_type": self.params_type,
            "params": len(self.params) if isinstance(self.params, Mapping) else self.params,
            "metrics": self.metrics,
            "current_round": self.current_round,
            "total_rounds": self.total_rounds,
            "meta": self.meta,
        }

    def __repr__(self) -> str:
        return f"FLModel({self.summary()})"


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
        params = _to_torch(params)
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
    params = _to_numpy(model.params or {}, "params")
    # Ours or a real nvflare's ParamsType: compared by value.
    sent_type = ParamsType(getattr(model.params_type, "value", model.params_type) or "FULL")
    params_type = sent_type
    # NVFlare's DIFF transfer turns a FULL model into its difference to the model received.
    if params and model.params_type is not None and sent_type is ParamsType.FULL and _transfer() == "DIFF":
        params = _diff(params, _session.received.params)
        params_type = ParamsType.DIFF
    if model.optimizer_params:
        print(
            "nvflare.client (flare-airflow): optimizer_params are not sent; FedAvg aggregates params only",
            file=sys.stderr,
            flush=True,
        )
    meta = _meta(model.meta or {})
    metrics = {**_session.scalars, **_scalars(model.metrics or {})}
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
        _session.scalars[key] = _scalar(value, key)
    elif kind in (AnalyticsDataType.SCALARS, AnalyticsDataType.METRICS):
        if not isinstance(value, Mapping):
            raise ClientAPIError(f"log({key!r}, ...): {kind.value} takes a dict of numbers, got {type(value).__name__}")
        prefix = f"{key}/" if kind is AnalyticsDataType.SCALARS else ""
        for name, item in value.items():
            _session.scalars[f"{prefix}{name}"] = _scalar(item, f"{prefix}{name}")
    # Text, images and parameters have no place in a round's metrics; they are not kept.


def clear() -> None:
    """NVFlare drops its cached task; here the one site job's state stays until the process ends."""


def shutdown() -> None:
    """Nothing to stop: no agent, no pipe."""


# --- conversions -------------------------------------------------------------------------------------


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def _to_numpy(params: Any, what: str) -> dict[str, np.ndarray]:
    if not isinstance(params, Mapping):
        raise ClientAPIError(
            f"FLModel.{what} must be a dict of arrays (or a torch state_dict), got {type(params).__name__}"
        )
    out: dict[str, np.ndarray] = {}
    for name, value in params.items():
        if _is_torch(value):
            value = value.detach().cpu()
            if str(value.dtype) == "torch.bfloat16":
                raise ClientAPIError(
                    f"FLModel.{what}[{name!r}] is a bfloat16 tensor, which numpy cannot hold: "
                    "send float32 (tensor.float()) or float16"
                )
            out[name] = np.ascontiguousarray(value.numpy())
        else:
            out[name] = np.asarray(value)
    return out


def _to_torch(params: dict[str, Any]) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        raise ClientAPIError(
            "this job exchanges params as pytorch tensors, but torch is not importable in the trainer's "
            "environment: install torch there, or set the job's trainer.nvflare.params_exchange to numpy"
        ) from None
    # A copy: the arrays read from the store may be read-only, and torch tensors are writable.
    return {name: torch.from_numpy(np.array(value)) for name, value in params.items()}


def _diff(params: dict[str, np.ndarray], received: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``new - received`` per name, in the sent dtype. A name only one side has is an error here
    (NVFlare drops it): the aggregation needs every tensor of the global model."""
    if set(params) != set(received):
        odd = sorted(set(params) ^ set(received))[:5]
        raise ClientAPIError(
            f"the job's transfer type is DIFF, but the params sent and the global model received differ in {odd}: "
            "a DIFF needs the same names as the model received"
        )
    return {name: np.subtract(value, received[name], dtype=value.dtype) for name, value in params.items()}


def _scalar(value: Any, key: str) -> float:
    if _is_torch(value) or isinstance(value, np.generic | np.ndarray):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClientAPIError(f"metric {key!r} is {type(value).__name__}; a round's metrics are numbers")
    return float(value)


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {str(key): _scalar(value, str(key)) for key, value in metrics.items()}


def _meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """NVFlare's meta as the update's meta: NUM_STEPS_CURRENT_ROUND becomes num_samples (the weight)."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if key == FLMetaKey.NUM_STEPS_CURRENT_ROUND:
            steps = value.item() if _is_torch(value) or isinstance(value, np.generic) else value
            if isinstance(steps, float) and math.isfinite(steps) and steps.is_integer():
                steps = int(steps)
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise ClientAPIError(
                    f"meta[{FLMetaKey.NUM_STEPS_CURRENT_ROUND!r}] is {steps!r}: it is this update's FedAvg weight "
                    "and must be a whole number >= 1 (the number of training steps or samples)"
                )
            out["num_samples"] = steps
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue  # the update's record is JSON: objects that are not stay in the trainer
        out[str(key)] = value
    return out
