"""The job's ``lora`` block: adapter fine-tuning of a language model that stays at the sites.

Only the adapter tensors (LoRA's A and B per target module) travel through the model store; the base
model is a file each site keeps, pinned by its sha256 here. The site runner hashes the site's copy
before the trainer starts and refuses a mismatch (:func:`flare_airflow.site_task.checks.check_base_model`).
The trainer reads this block from ``FLARE_LORA`` (the Client API's :func:`~flare_airflow.client.get_lora`).
See docs/llm.md.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from flare_airflow.core.config.validators import Strict, not_blank
from flare_airflow.core.digests import HEX_DIGEST

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,127}\Z")


class BaseModelSpec(Strict):
    """The base model's file at the sites and its digest."""

    file: str = Field(description="the base model file (GGUF or safetensors), relative to the job file")
    sha256: str = Field(description="its sha256 (64 lowercase hex digits): every site's copy must match")

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        return not_blank(
            value, "lora.base_model.file", "must name the base model file (relative to the job file, or absolute)"
        )

    @field_validator("sha256")
    @classmethod
    def _sha256(cls, value: str) -> str:
        if not HEX_DIGEST.match(value):
            raise ValueError(f"sha256 must be 64 lowercase hex digits (`sha256sum FILE`), got {value[:80]!r}")
        return value


class LoraSpec(Strict):
    """Low-rank adapters (Hu et al., 2021) on ``target_modules`` of the base model."""

    base_model: BaseModelSpec
    target_modules: list[str] = Field(description="names of the base model's linear layers that get adapters")
    rank: int = Field(8, ge=1, le=1024, description="the adapters' rank r")
    alpha: float = Field(16.0, gt=0, le=1e6, description="the adapters' scale is alpha / rank")
    seq_len: int = Field(128, ge=8, le=32768, description="tokens per training sequence")
    steps_per_round: int = Field(10, ge=1, le=1_000_000, description="optimizer steps per site and round")

    @field_validator("target_modules")
    @classmethod
    def _modules(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one module, e.g. [q_proj, v_proj]")
        for name in value:
            if not _MODULE.match(name):
                raise ValueError(f"target module {name[:80]!r} is not a module name (letters, digits, '_', '.')")
        if len(set(value)) != len(value):
            raise ValueError(f"target modules repeat: {value}")
        return value

    def for_trainer(self, base_model_path: str, frozen: tuple[str, ...]) -> dict[str, Any]:
        """What the trainer reads from ``FLARE_LORA``: this block with the site's verified base model
        path, and the adapter tensors the aggregation keeps frozen (glob patterns)."""
        return {
            "base_model": base_model_path,
            "base_model_sha256": self.base_model.sha256,
            "target_modules": list(self.target_modules),
            "rank": self.rank,
            "alpha": self.alpha,
            "seq_len": self.seq_len,
            "steps_per_round": self.steps_per_round,
            "frozen": list(frozen),
        }
