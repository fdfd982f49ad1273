"""The nvflare stand-in beside a real NVFlare 2.9, and PyTorch state_dicts through it (side environments).

Neither environment has Airflow; the trainer reaches flare-airflow's Client API through
``PYTHONPATH`` (as a site image has the ``client`` extra installed).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file

from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.nvflare import client as stand_in
from flare_airflow_testing.side_venvs import SideVenv

REPO = pathlib.Path(__file__).resolve().parents[2]


def site_env(side: SideVenv, tmp_path: pathlib.Path, global_model: pathlib.Path) -> dict[str, str]:
    return {
        **side.env(),
        "PYTHONPATH": str(REPO),
        "FLARE_JOB": "interop",
        "FLARE_RUN_ID": "manual__1",
        "FLARE_SITE": "site-1",
        "FLARE_ROUND": "1",
        "FLARE_TOTAL_ROUNDS": "2",
        "FLARE_TASK": "train",
        "FLARE_GLOBAL_MODEL": str(global_model),
        "FLARE_OUTPUT": str(tmp_path / "out" / "update.safetensors"),
        "FLARE_HPARAMS": "{}",
    }


def run_trainer(side: SideVenv, env: dict[str, str], script: pathlib.Path, *runner_args: str) -> str:
    proc = subprocess.run(
        [str(side.python), "-m", "flare_airflow.core.nvflare.run", *runner_args, str(script)],
        env=env,
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


PROBE_REAL = """\
import json, inspect
from nvflare.apis.analytix import AnalyticsDataType
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.np.constants import NPConstants
print(json.dumps({
    "NUMPY_KEY": NPConstants.NUMPY_KEY,
    "FLMetaKey": {k: v for k, v in vars(FLMetaKey).items() if not k.startswith("_")},
    "ParamsType": [p.value for p in ParamsType],
    "AnalyticsDataType": [a.value for a in AnalyticsDataType],
    "FLModel": list(inspect.signature(FLModel.__init__).parameters),
}))
"""

PROBE_STAND_IN = """\
import json
import nvflare
import nvflare.client as flare
from nvflare.app_common.np.constants import NPConstants
from nvflare.app_common.np.recipes import NumpyFedAvgRecipe  # the real package's module, still importable
from nvflare.fuel.utils.import_utils import optional_import  # likewise

flare.init()
model = flare.receive()
flare.send(flare.FLModel(params={NPConstants.NUMPY_KEY: model.params[NPConstants.NUMPY_KEY] * 2}))
print("PROBE " + json.dumps({
    "client": flare.receive.__module__,
    "model": type(model).__module__,
    "recipe": NumpyFedAvgRecipe.__module__,
    "running": flare.is_running(),
}))
"""


def test_stand_in_matches_and_takes_precedence_over_a_real_nvflare(nvflare_side: SideVenv, tmp_path) -> None:
    real = subprocess.run(
        [str(nvflare_side.python), "-c", PROBE_REAL],
        env=nvflare_side.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert real.returncode == 0, real.stderr[-2000:]
    names = json.loads(real.stdout.strip().splitlines()[-1])
    # The stand-in's names and values are NVFlare 2.9's own.
    assert names["NUMPY_KEY"] == "numpy_key"
    ours = {k: v for k, v in vars(stand_in.FLMetaKey).items() if not k.startswith("_")}
    assert ours == names["FLMetaKey"]
    assert [p.value for p in stand_in.ParamsType] == names["ParamsType"]
    assert [a.value for a in stand_in.AnalyticsDataType] == names["AnalyticsDataType"]
    assert list(stand_in.FLModel.__init__.__code__.co_varnames[:9]) == names["FLModel"]

    start = tmp_path / "global.safetensors"
    write_artifact(start, FLModel(params={"numpy_key": np.full((2, 2), 1.5, np.float32)}))
    script = tmp_path / "probe.py"
    script.write_text(PROBE_STAND_IN)
    env = site_env(nvflare_side, tmp_path, start)
    stdout = run_trainer(nvflare_side, env, script)
    probe = json.loads(stdout.split("PROBE ", 1)[1])
    assert probe == {
        "client": "flare_airflow.core.nvflare.client",  # the stand-in answered, not NVFlare's pipe client
        "model": "nvflare.app_common.abstract.fl_model",  # with the real package's FLModel
        "recipe": "nvflare.app_common.np.recipes.fedavg",
        "running": False,
    }
    sent, _ = read_artifact(pathlib.Path(env["FLARE_OUTPUT"]))
    np.testing.assert_array_equal(sent["numpy_key"], np.full((2, 2), 3.0, np.float32))


HELLO_PT = """\
import os
import torch
import nvflare.client as flare
from nvflare.apis.fl_constant import FLMetaKey
from safetensors.torch import save_file

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
flare.init()
while flare.is_running():
    model = flare.receive()
    assert all(isinstance(v, torch.Tensor) for v in model.params.values()), model.params
    save_file({k: v.contiguous() for k, v in model.params.items()}, os.environ["RECEIVED"])
    net.load_state_dict(model.params)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    state = net.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, os.environ["TRAINED"])
    flare.send(flare.FLModel(params=state, meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: 8}))
"""


@pytest.mark.parametrize("transfer", ["FULL", "DIFF"])
def test_pytorch_state_dict_in_and_out_bit_exact(torch_side: SideVenv, tmp_path, transfer: str) -> None:
    rng = np.random.default_rng(7)
    start = {
        "0.weight": rng.standard_normal((3, 4)).astype(np.float32),
        "0.bias": rng.standard_normal(3).astype(np.float32),
        "1.weight": np.ones(3, np.float32),
        "1.bias": np.zeros(3, np.float32),
        "1.running_mean": np.zeros(3, np.float32),
        "1.running_var": np.ones(3, np.float32),
        "1.num_batches_tracked": np.array(5, np.int64),
    }
    global_model = tmp_path / "global.safetensors"
    write_artifact(global_model, FLModel(params=start))
    script = tmp_path / "hello_pt.py"
    script.write_text(textwrap.dedent(HELLO_PT))
    env = site_env(torch_side, tmp_path, global_model)
    env |= {"RECEIVED": str(tmp_path / "received.safetensors"), "TRAINED": str(tmp_path / "trained.safetensors")}
    run_trainer(torch_side, env, script, "--params-exchange", "pytorch", "--transfer", transfer)

    received = load_file(env["RECEIVED"])  # what the script got, as torch tensors, saved by torch
    assert received.keys() == start.keys()
    for name, value in start.items():
        assert received[name].dtype == value.dtype
        assert received[name].tobytes() == value.tobytes(), name
    trained = load_file(env["TRAINED"])
    sent, record = read_artifact(pathlib.Path(env["FLARE_OUTPUT"]))
    assert record.params_type.value == transfer and record.num_samples == 8
    assert int(trained["1.num_batches_tracked"]) == 8  # the state_dict's int64 buffer travelled too
    for name, value in trained.items():
        expected = value if transfer == "FULL" else value - start[name]
        assert sent[name].dtype == value.dtype
        assert sent[name].tobytes() == expected.tobytes(), name
    assert os.path.exists(env["RECEIVED"])
