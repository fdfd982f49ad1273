"""NVFlare 2.9's Client API on flare-airflow's: the mapping, the contract errors, the runner, the state check.

Without nvflare installed (the project's environment has none): the stand-in is what
``import nvflare.client`` finds. Against a real NVFlare 2.9 and PyTorch: tests/integration/test_nvflare.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from flare_airflow.core import client as native
from flare_airflow.core.envvars import FLARE_NVFLARE_PARAMS_EXCHANGE, FLARE_NVFLARE_TRANSFER
from flare_airflow.core.errors import ClientAPIError
from flare_airflow.core.model import read_artifact
from flare_airflow.core.nvflare import client as nv
from flare_airflow.core.nvflare.run import SHIM_DIR
from flare_airflow.core.nvflare.state_check import check_source
from flare_airflow.core.nvflare.tracking import SummaryWriter

from .test_client import flare_env

REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture
def nv_env(tmp_path, global_model, monkeypatch) -> dict[str, str]:
    """A fresh trainer process's state (both sessions) and its launch environment."""
    monkeypatch.setattr(native, "_session", native._Session())
    monkeypatch.setattr(nv, "_session", nv._Session())
    for name in (FLARE_NVFLARE_PARAMS_EXCHANGE, FLARE_NVFLARE_TRANSFER, "FLARE_HANDSHAKE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    values = flare_env(tmp_path, global_model)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


def test_one_round_per_process_maps_rounds_meta_metrics_and_weight(nv_env) -> None:
    nv.init()
    nv.init()  # a second init is ignored, as NVFlare's
    assert nv.is_running()
    model = nv.receive()
    assert model is not None and nv.receive() is model  # the same task until the send
    assert (model.current_round, model.total_rounds) == (2, 5)  # FLARE_ROUND 3 of 5, counted from 0
    assert model.params_type is nv.ParamsType.FULL
    assert model.meta[nv.FLMetaKey.CURRENT_ROUND] == 2
    assert nv.system_info() == {"site_name": "site-2", "job_id": nv_env["FLARE_RUN_ID"]}
    assert (nv.get_site_name(), nv.get_job_id()) == ("site-2", nv_env["FLARE_RUN_ID"])
    assert nv.is_train() and not nv.is_evaluate() and not nv.is_submit_model()
    assert nv.get_task_name() == "train"
    writer = SummaryWriter()
    writer.add_scalar("loss", 0.9, global_step=0)
    writer.add_scalar("loss", 0.25, global_step=1)  # the last value of a tag is the round's
    writer.add_scalars("acc", {"train": 0.5}, global_step=1)
    params = {k: v + 1 for k, v in model.params.items()}
    nv.send(
        nv.FLModel(
            params=params,
            metrics={"val": np.float32(0.75)},
            meta={nv.FLMetaKey.NUM_STEPS_CURRENT_ROUND: 12.0, "note": "x", "obj": object()},
        )
    )
    assert not nv.is_running()
    assert nv.receive() is None  # the job ends for this process, as NVFlare's receive at the end
    sent, record = read_artifact(pathlib.Path(nv_env["FLARE_OUTPUT"]))
    np.testing.assert_array_equal(sent["w"], np.full((2, 3), 2, np.float32))
    assert record.params_type.value == "FULL"
    assert record.num_samples == 12  # NUM_STEPS_CURRENT_ROUND is the FedAvg weight
    assert record.metrics == {"loss": 0.25, "acc/train": 0.5, "val": 0.75}
    assert record.meta == {"note": "x"}  # what is not JSON stays in the trainer


def test_diff_transfer_sends_the_difference_to_the_model_received(nv_env, monkeypatch) -> None:
    monkeypatch.setenv(FLARE_NVFLARE_TRANSFER, "DIFF")
    nv.init()
    model = nv.receive()
    assert model is not None
    nv.send(nv.FLModel(params={"w": model.params["w"] * 3, "b": model.params["b"] + 0.5}))
    sent, record = read_artifact(pathlib.Path(nv_env["FLARE_OUTPUT"]))
    assert record.params_type.value == "DIFF"
    np.testing.assert_array_equal(sent["w"], np.full((2, 3), 2, np.float32))
    np.testing.assert_array_equal(sent["b"], np.full(3, 0.5, np.float32))
    assert sent["w"].dtype == np.float32


def test_contract_errors_are_nvflares_runtime_errors(nv_env) -> None:
    with pytest.raises(RuntimeError, match=r"Did you call flare.init\(\) before using the Client API"):
        nv.receive()
    nv.init()
    with pytest.raises(RuntimeError, match=r'"receive" needs to be called before sending model!'):
        nv.send(nv.FLModel(params={"w": np.zeros((2, 3), np.float32)}))
    model = nv.receive()
    assert model is not None
    nv.send(nv.FLModel(params=model.params))
    with pytest.raises(RuntimeError, match=r'"receive" needs to be called before sending model!') as second:
        nv.send(nv.FLModel(params=model.params))
    assert isinstance(second.value, ClientAPIError)


def test_bad_weight_and_metric_are_named(nv_env) -> None:
    nv.init()
    model = nv.receive()
    assert model is not None
    with pytest.raises(ClientAPIError, match=r"NUM_STEPS_CURRENT_ROUND.*whole number >= 1"):
        nv.send(nv.FLModel(params=model.params, meta={"NUM_STEPS_CURRENT_ROUND": 2.5}))
    with pytest.raises(ClientAPIError, match=r"metric 'acc' is str"):
        nv.send(nv.FLModel(params=model.params, metrics={"acc": "high"}))
    with pytest.raises(TypeError, match=r"model needs to be an instance of FLModel"):
        nv.send({"w": 1})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"does not have either params or metrics"):
        nv.send(nv.FLModel())
    assert nv.is_running()  # nothing was sent


def test_pytorch_exchange_without_torch_says_what_to_do(nv_env, monkeypatch) -> None:
    monkeypatch.setenv(FLARE_NVFLARE_PARAMS_EXCHANGE, "pytorch")
    monkeypatch.setitem(sys.modules, "torch", None)  # as in an image without torch
    nv.init()
    with pytest.raises(ClientAPIError, match=r"torch is not importable.*params_exchange to numpy"):
        nv.receive()


HELLO_NUMPY = """\
import nvflare.client as flare
from nvflare.app_common.np.constants import NPConstants
from nvflare.client.tracking import SummaryWriter
from nvflare.app_common.abstract.fl_model import FLModel as Deep
from nvflare.apis.fl_constant import FLMetaKey

import helper  # a sibling module, found as `python script.py` finds it

flare.init()
writer = SummaryWriter()
rounds_seen = 0
while flare.is_running():
    model = flare.receive()
    if model is None:
        break
    assert Deep is flare.FLModel
    rounds_seen += 1
    writer.add_scalar("seen", rounds_seen, 0)
    w = model.params[NPConstants.NUMPY_KEY]
    flare.send(flare.FLModel(params={NPConstants.NUMPY_KEY: w + helper.STEP},
                             meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: 3}))
print("ARGV", __import__("json").dumps(__import__("sys").argv))
"""


def test_runner_runs_an_unmodified_script_without_nvflare(tmp_path, nv_env) -> None:
    """``python -m flare_airflow.core.nvflare.run`` in a subprocess: the stand-in, argv, sys.path, notes."""
    from flare_airflow.core.model import FLModel, write_artifact

    script_dir = tmp_path / "app"
    script_dir.mkdir()
    (script_dir / "client.py").write_text(HELLO_NUMPY)
    (script_dir / "helper.py").write_text("STEP = 1\n")
    start = tmp_path / "hello.safetensors"
    write_artifact(start, FLModel(params={"numpy_key": np.arange(1, 10, dtype=np.float32).reshape(3, 3)}))
    env = {**os.environ, **nv_env, "FLARE_GLOBAL_MODEL": str(start)}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "flare_airflow.core.nvflare.run", str(script_dir / "client.py"), "--lr", "0.1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.split("ARGV ", 1)[1]) == [str(script_dir / "client.py"), "--lr", "0.1"]
    assert "this process runs ONE round" in proc.stderr
    # The counter the script accumulates across rounds is named, with its line.
    assert f"{script_dir / 'client.py'}:17: 'rounds_seen'" in proc.stderr
    sent, record = read_artifact(pathlib.Path(nv_env["FLARE_OUTPUT"]))
    np.testing.assert_array_equal(sent["numpy_key"], np.arange(2, 11, dtype=np.float32).reshape(3, 3))
    assert record.num_samples == 3 and record.metrics == {"seen": 1.0}


def test_stand_in_is_laid_out_as_the_nvflare_package() -> None:
    expected = {
        "nvflare/client/__init__.py",
        "nvflare/client/tracking.py",
        "nvflare/app_common/abstract/fl_model.py",
        "nvflare/app_common/np/constants.py",
        "nvflare/apis/fl_constant.py",
        "nvflare/apis/analytix.py",
    }
    assert expected <= {str(p.relative_to(SHIM_DIR)) for p in SHIM_DIR.rglob("*.py")}


def test_state_check_names_state_kept_across_rounds() -> None:
    source = textwrap.dedent(
        """\
        import torch
        import nvflare.client as flare

        def main():
            net = Net()
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
            total_steps = 0
            history = []
            flare.init()
            while flare.is_running():
                model = flare.receive()
                net.load_state_dict(model.params)
                for batch in loader:
                    optimizer.step()
                    total_steps += 1
                scheduler.step()
                history.append(1)
                flare.send(flare.FLModel(params=net.state_dict()))

        if __name__ == "__main__":
            main()
        """
    )
    found = {(f.line, f.message.split(" ", 1)[0]) for f in check_source(source)}
    assert found == {(6, "'optimizer'"), (7, "'scheduler'"), (16, "'total_steps'"), (18, "'history'")}
    clean = "import nvflare.client as flare\nflare.init()\nwhile flare.is_running():\n    m = flare.receive()\n"
    assert check_source(clean) == []
    assert check_source("def broken(:\n") == []  # Python reports syntax errors itself
