"""Register the job schema with Hydra's ConfigStore and convert composed configs to dataclasses."""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megatron_rl.config.schema import JobConfig

SCHEMA_NAME = "megatron_rl_schema"
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def register() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=JobConfig)


def to_job_config(cfg: DictConfig) -> JobConfig:
    """Resolve interpolations and build the ``JobConfig`` dataclass tree (the only form library code sees)."""
    return OmegaConf.to_object(cfg)


register()
