"""Register the job schema with Hydra's ConfigStore and convert composed configs to dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterator
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megatron_rl.config.schema import JobConfig
from megatron_rl.config.validate import ConfigError

SCHEMA_NAME = "megatron_rl_schema"
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def register() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=JobConfig)


def schema_keys(cls: type = JobConfig, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the schema, nested dataclasses expanded (``actor.optim.lr``...)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from schema_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _unknown_keys(node: dict, cls: type, prefix: str = "") -> Iterator[str]:
    hints = typing.get_type_hints(cls)
    for key, value in node.items():
        if key not in hints:
            yield f"{prefix}{key}"
        elif dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            yield from _unknown_keys(value, hints[key], f"{prefix}{key}.")


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse keys the schema does not define. Hydra's ``+key=value`` (which Hydra itself suggests after a
    typo) adds a key to the structured config, and the dataclass conversion then drops it silently."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    unknown = list(_unknown_keys(plain, JobConfig))
    if not unknown:
        return
    known = list(schema_keys())
    key = unknown[0]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    leaf = difflib.get_close_matches(key.rsplit(".", 1)[-1], [k.rsplit(".", 1)[-1] for k in known], n=1)
    if not close and leaf:
        close = [k for k in known if k.rsplit(".", 1)[-1] == leaf[0]][:1]
    hint = f"Did you mean {close[0]}? Set it without '+': {close[0]}=<value>." if close else ""
    more = f" (and {len(unknown) - 1} more: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
    raise ConfigError(
        f"unknown config key {key}{more}: the schema (megatron_rl/config/schema.py) has no such key, so "
        f"it would be ignored. {hint} The README's config reference lists every key."
    )


def to_job_config(cfg: DictConfig) -> JobConfig:
    """Check for unknown keys, resolve interpolations and build the ``JobConfig`` dataclass tree (the only
    form library code sees). Raises ``ConfigError``."""
    check_known_keys(cfg)
    return OmegaConf.to_object(cfg)


register()
