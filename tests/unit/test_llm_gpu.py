"""The LoRA example's GPU path when there is no GPU (docs/llm.md, "GPU sites"): `make llm-demo-gpu`
and a site job told to use CUDA stop with a sentence and exit 3, never fall back to the CPU silently.

torch never enters Airflow's environment, so the trainer's checks take torch as an argument and
these tests hand them stand-ins with torch's attributes (a CPU build; a CUDA build without devices).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import pytest

TRAINER = pathlib.Path(__file__).resolve().parents[2] / "examples" / "llm_lora" / "trainer.py"


@pytest.fixture(scope="module")
def trainer() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("llm_lora_trainer", TRAINER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_torch(*, cuda_build: str | None, devices: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        __version__="2.13.0",
        version=types.SimpleNamespace(cuda=cuda_build),
        cuda=types.SimpleNamespace(is_available=lambda: devices > 0, device_count=lambda: devices),
        device=lambda name: f"torch.device({name})",
    )


def test_count_cuda_on_a_cpu_build_exits_3_saying_why(trainer, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert trainer.count_cuda(fake_torch(cuda_build=None, devices=0)) == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert "no CUDA device: this torch (2.13.0) is a CPU build (CUDA_VISIBLE_DEVICES='')" in err
    assert "`make llm-demo` runs the same federation on the CPU" in err


def test_count_cuda_with_a_cuda_build_and_no_visible_device_exits_3(trainer, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # what the allocator granted; nothing there
    assert trainer.count_cuda(fake_torch(cuda_build="12.4", devices=0)) == 3
    assert "torch 2.13.0 (CUDA 12.4) sees no CUDA device (CUDA_VISIBLE_DEVICES='7')" in capsys.readouterr().err


def test_count_cuda_prints_the_device_count(trainer, capsys) -> None:
    assert trainer.count_cuda(fake_torch(cuda_build="12.4", devices=2)) == 0
    assert capsys.readouterr().out == "2\n"


def test_a_site_job_told_to_use_cuda_fails_instead_of_training_on_the_cpu(trainer, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda_build=None, devices=0))
    monkeypatch.setenv("FLARE_LM_DEVICE", "cuda")
    with pytest.raises(SystemExit) as exited:
        trainer.device()
    assert exited.value.code == 3
    assert "FLARE_LM_DEVICE=cuda but this torch (2.13.0) is a CPU build" in capsys.readouterr().err
    monkeypatch.delenv("FLARE_LM_DEVICE")  # the plain demo: the CPU, said plainly
    assert trainer.device() == "torch.device(cpu)"
    assert "training on the CPU: this torch (2.13.0) is a CPU build" in capsys.readouterr().out
