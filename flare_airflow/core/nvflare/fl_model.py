"""NVFlare 2.9's data objects as its Client API scripts use them: ``FLModel``, ``ParamsType``,
``FLMetaKey``, ``AnalyticsDataType`` -- the same constructors, attributes and values -- and the
errors and messages NVFlare's Client API raises (:mod:`.client` is the API itself)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from flare_airflow.core.errors import ClientAPIError

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
