"""LoRA fine-tuning of a small language model: ``dags/llm_lora.yaml`` as an Airflow DAG (``flare_llm_lora``).

The trainers need torch, transformers and peft, which never enter Airflow's environment: they run with
the Python of the language-model environment, ``FLARE_LM_PYTHON`` or this checkout's ``.lm-venv``
(``make lm-env``). See docs/llm.md.
"""

import os
from pathlib import Path

import yaml

from flare_airflow.builder import build_dag
from flare_airflow.core.config import job_from_dict

JOB_FILE = Path(__file__).with_name("llm_lora.yaml")
LM_PYTHON = os.environ.get("FLARE_LM_PYTHON") or str(Path(__file__).resolve().parent.parent / ".lm-venv/bin/python")

job = yaml.safe_load(JOB_FILE.read_text())
job["trainer"]["command"] = [LM_PYTHON]
# `make llm-demo-gpu` sets FLARE_LM_GPUS to the devices torch sees: every site job then takes one from a
# pool of them on this host, the site runner's allocator sets its CUDA_VISIBLE_DEVICES, and the trainer
# (FLARE_LM_DEVICE=cuda) refuses to fall back to the CPU.
if gpus := int(os.environ.get("FLARE_LM_GPUS") or 0):
    job["sites"]["@default"]["resource_spec"] = {"num_of_gpus": 1}
    job["sites"]["@default"]["resource_manager"] = {"type": "gpu", "num_of_gpus": gpus, "pool": "llm_lora_gpus"}
dag = build_dag(job_from_dict(job, source=str(JOB_FILE), base_dir=str(JOB_FILE.parent.resolve())))
