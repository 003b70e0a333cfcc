"""``megatron-rl ckpt info DIR``: what a training checkpoint holds, read from its files alone.

Reads the JSON files a checkpoint directory carries (manifest, host state, model description) and the
sizes on disk, and verifies every file against the manifest's size and content digest with the same
(pure filesystem) check a resume runs; it loads no tensor and unpickles nothing, so it works on any machine,
on a checkpoint of any layout, and cannot run anything stored in it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.checkpoint.layout import check_files, read_manifest
from megatron_rl.checkpoint.names import CKPT_DIR, DIST, HF, MANIFEST, META_FILE, POINTER, RNG, STATE
from megatron_rl.checkpoint.names import STEP_DIR as _STEP_DIR


@dataclass
class CheckpointSummary:
    path: Path
    step: int | None
    model: dict = field(default_factory=dict)  # ModelArgs fields from megatron_rl_model.json
    layout: dict = field(default_factory=dict)  # world_size / tp / pp / dp it was saved with
    contents: dict[str, bool] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # top-level entry -> bytes
    problems: list[str] = field(default_factory=list)  # empty: the manifest verifies

    @property
    def verified(self) -> bool:
        return not self.problems


def _read_json(path: Path, problems: list[str]) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        problems.append(f"{path.name} is unreadable ({err})")
        return {}


def resolve_step_dir(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint; else the newest ``global_step_<N>`` under
    ``path/checkpoints`` or ``path`` (a run's output dir or its checkpoints folder)."""
    p = Path(path)
    if (p / MANIFEST).exists() or (p / STATE).exists() or _STEP_DIR.match(p.name):
        return p
    for root in (p / CKPT_DIR, p):
        pointer = root / POINTER
        if pointer.is_file() and (root / f"global_step_{pointer.read_text().strip()}").is_dir():
            return root / f"global_step_{pointer.read_text().strip()}"
        steps = sorted(
            (int(m.group(1)), d) for d in root.glob("global_step_*") if (m := _STEP_DIR.match(d.name))
        )
        if steps:
            return steps[-1][1]
    raise FileNotFoundError(
        f"{p} is not a checkpoint (no {MANIFEST} or {STATE}) and holds no global_step_<N> directory; pass "
        f"<trainer.output_dir>/{CKPT_DIR}/global_step_<N> or the run's trainer.output_dir"
    )


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def verify_manifest(step_dir: Path) -> list[str]:
    """Every reason ``step_dir`` would be rejected on resume (missing file, wrong size, other content than
    its digest says), one per file, with the resume's own per-file check."""
    info, reason = read_manifest(step_dir)
    if reason:
        return [f"{reason}: the write did not finish, or this is not a training checkpoint"]
    return [r for rel in info["files"] if (r := check_files(step_dir, info["files"], [rel]))]


def inspect_checkpoint(path: str | Path) -> CheckpointSummary:
    step_dir = resolve_step_dir(path)
    problems: list[str] = []
    manifest = _read_json(step_dir / MANIFEST, problems)
    state = _read_json(step_dir / STATE, problems)
    meta = _read_json(step_dir / META_FILE, problems)
    step = state.get("step", manifest.get("step", meta.get("iteration")))
    roles = state.get("roles", [meta["role"]] if meta.get("role") else [])
    layout = state.get("layout") or {k: meta[k] for k in ("tp", "pp") if k in meta}
    contents = {
        "actor": "actor" in roles,
        "critic": "critic" in roles,
        "optimizer": bool(state.get("optimizers")),
        "rng": (step_dir / RNG).is_dir() and any((step_dir / RNG).iterdir()),
        "hf_export": (step_dir / HF / "config.json").is_file(),
    }
    sizes = {entry.name: _size(entry) for entry in sorted(step_dir.iterdir())}
    problems += verify_manifest(step_dir)
    if not (step_dir / DIST).is_dir():
        problems.append(f"no {DIST}/ (the megatron-core weights)")
    return CheckpointSummary(step_dir, step, meta.get("model_args", {}), layout, contents, sizes, problems)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_summary(s: CheckpointSummary) -> str:
    m = s.model
    shape = (
        f"{m.get('num_layers')} layers, hidden {m.get('hidden_size')}, {m.get('num_attention_heads')} heads "
        f"({m.get('num_query_groups')} KV groups), ffn {m.get('ffn_hidden_size')}, vocab {m.get('vocab_size')}"
        if m
        else "unknown (no megatron_rl_model.json)"
    )
    layout = ", ".join(f"{k.upper() if len(k) == 2 else k}={v}" for k, v in s.layout.items()) or "unknown"
    has = [k for k, v in s.contents.items() if v]
    lacks = [k for k, v in s.contents.items() if not v]
    lines = [
        f"checkpoint  {s.path}",
        f"step        {s.step}",
        f"model       {shape}",
        f"saved with  {layout}",
        f"contains    {', '.join(has) or 'nothing recognised'}"
        + (f" (no {', '.join(lacks)})" if lacks else ""),
        f"size        {_human(sum(s.sizes.values()))}: "
        + ", ".join(f"{name} {_human(n)}" for name, n in s.sizes.items()),
        "verified    ok (every file in the manifest is present with its size)"
        if s.verified
        else "verified    NO: " + "; ".join(s.problems),
    ]
    return "\n".join(lines)
