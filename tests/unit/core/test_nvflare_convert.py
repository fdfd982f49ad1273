"""core/nvflare/convert.py: what crosses between an NVFlare script's objects and the update."""

from __future__ import annotations

import numpy as np
import pytest

from flare_airflow.core.errors import ClientAPIError
from flare_airflow.core.nvflare.convert import diff_from, scalars, to_numpy, update_meta


def test_a_diff_keeps_the_sent_dtype_and_refuses_names_the_received_model_lacks() -> None:
    received = {"w": np.array([1.0, 2.0], np.float32)}
    sent = {"w": np.array([1.5, 2.5], np.float32)}
    out = diff_from(sent, received)
    assert out["w"].dtype == np.float32 and out["w"].tolist() == [0.5, 0.5]
    with pytest.raises(ClientAPIError, match=r"differ in \['extra'\]: a DIFF needs the same names"):
        diff_from({**sent, "extra": np.zeros(1)}, received)


def test_num_steps_is_the_fedavg_weight_and_what_is_not_json_stays_in_the_trainer() -> None:
    meta = update_meta({"NUM_STEPS_CURRENT_ROUND": np.int64(12), "note": "x", "handle": object()})
    assert meta == {"num_samples": 12, "note": "x"}
    assert update_meta({"NUM_STEPS_CURRENT_ROUND": 3.0}) == {"num_samples": 3}
    for bad in (0, 2.5, True, "7"):
        with pytest.raises(ClientAPIError, match="must be a whole number >= 1"):
            update_meta({"NUM_STEPS_CURRENT_ROUND": bad})


def test_metrics_are_numbers_and_params_a_dict_of_arrays() -> None:
    assert scalars({"loss": np.float32(0.25), "n": 3}) == {"loss": 0.25, "n": 3.0}
    with pytest.raises(ClientAPIError, match="metric 'ok' is bool"):
        scalars({"ok": True})
    assert to_numpy({"w": [1, 2]}, "params")["w"].tolist() == [1, 2]
    with pytest.raises(ClientAPIError, match=r"FLModel\.params must be a dict of arrays"):
        to_numpy([1, 2], "params")
