"""Generate the README's config reference from the dataclasses: ``python -m megatron_rl.config.reference``."""

from __future__ import annotations

import dataclasses

from megatron_rl.config.schema import JobConfig

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _rows(instance, prefix: str):
    """Rows of a config *instance*: nested sections are read from the parent's own default (e.g.
    ``CriticConfig.optim`` is ``OptimConfig(lr=1e-5)``), not rebuilt from their class defaults."""
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            yield from _rows(value, f"{prefix}{f.name}.")
        else:
            default = "null" if value is None else repr(value) if isinstance(value, str) else str(value)
            yield f"| `{prefix}{f.name}` | `{default}` | {f.metadata.get('doc', '').replace('|', '/')} |"


def render() -> str:
    lines = [BEGIN, "| key | default | meaning |", "| --- | --- | --- |", *_rows(JobConfig(), ""), END]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
