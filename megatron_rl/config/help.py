"""``megatron-rl train --help``: every key with its value after the YAML groups and what it does.

The descriptions are the schema's ``doc(...)`` texts (the README's config reference reads the same ones);
the values are the composed config for the overrides given, so ``--help algorithm=ppo`` shows PPO's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

from omegaconf import OmegaConf

from megatron_rl.config.schema import JobConfig

_GROUPS = ("algorithm", "model", "experiment")


def group_options(config_dir: str) -> dict[str, list[str]]:
    """The options of each YAML group: the file names under ``configs/<group>/``."""
    return {g: sorted(p.stem for p in (Path(config_dir) / g).glob("*.yaml")) for g in _GROUPS}


def schema_docs(cls: type = JobConfig, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted key, doc text)`` for every leaf field of the schema, in declaration order."""
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, type) else None
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) or (kind and dataclasses.is_dataclass(kind)):
            yield from schema_docs(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.metadata.get("doc", "")


def _show(value) -> str:
    return "null" if value is None else str(value)


def render_help(command: str, overrides: Sequence[str] = ()) -> str:
    """The help page of ``megatron-rl <command>`` for ``overrides`` (Hydra syntax)."""
    from hydra import compose, initialize_config_dir

    from megatron_rl.config.store import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        given = any(o.lstrip("+").startswith("trainer.output_dir=") for o in overrides)
        # compose cannot resolve ${hydra:runtime.output_dir}: show the directory Hydra would pick
        default = [] if given else ["trainer.output_dir=outputs/DATE/TIME"]
        cfg = compose("config", overrides=[*overrides, *default])
    lines = [
        f"usage: megatron-rl {command} [key=value ...] [group=option ...]",
        "",
        "Hydra overrides set any key below (e.g. actor.optim.lr=1e-6); -m sweeps comma-separated values;",
        "--cfg job prints the composed config; --hydra-help lists Hydra's own flags.",
        "",
        "groups:",
        *(f"  {g}={' | '.join(options)}" for g, options in group_options(CONFIG_DIR).items()),
        "",
        "keys (value with these overrides, then what it does):",
    ]
    docs = list(schema_docs())
    width = max(len(f"{k}={_show(OmegaConf.select(cfg, k))}") for k, _ in docs) + 2
    for key, text in docs:
        shown = f"{key}={_show(OmegaConf.select(cfg, key))}"
        lines.append(f"  {shown:<{min(width, 52)}} {text}")
    return "\n".join(lines)
