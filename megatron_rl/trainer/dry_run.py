"""`trainer.dry_run=true`: print the resolved layout, the memory model's estimate per phase and what the
``auto`` keys resolve to, then exit (non-zero, with the key to change, when the job cannot fit).

Works from the HF config.json alone (or the built-in tiny model's settings), before any process group,
model or GPU memory exists; the GPU's memory comes from the device or ``trainer.gpu_memory_gb``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_rl.config.schema import JobConfig
from megatron_rl.config.validate import ConfigError
from megatron_rl.distributed.dims import ParallelDims
from megatron_rl.models.args import ModelArgs, find_hf_config
from megatron_rl.trainer.memory_model import GIB, estimate, micro_shape
from megatron_rl.trainer.memory_plan import apply_plan, gpu_memory_bytes, plan


def read_arch(cfg: JobConfig, tp: int = 1) -> tuple[ModelArgs, str]:
    """(model facts, where they came from): model.path's config.json, or the built-in tiny model."""
    m = cfg.model
    if m.path is None:
        from megatron_rl.tasks.last_digit import builtin_tokenizer

        vocab = len(builtin_tokenizer(builtin_data=cfg.data.train_files is None))
        hf = dict(model_type="qwen2", num_hidden_layers=m.num_layers, hidden_size=m.hidden_size,
                  num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                  intermediate_size=m.ffn_hidden_size, vocab_size=vocab, tie_word_embeddings=True)  # fmt: skip
        return ModelArgs.from_hf_config(hf, tp=tp), "built-in tiny model (model.path unset)"
    found = find_hf_config(m.path)
    if found is None:
        raise FileNotFoundError(f"model.path={m.path!r} has no config.json (looked in {m.path} and "
                                f"{m.path}/hf_config); point model.path at an HF model directory")  # fmt: skip
    return ModelArgs.from_hf_config(found, tp=tp), str(found)


def micro_batches(cfg: JobConfig, dims: ParallelDims, role: str, p: int | None = None) -> dict[str, int]:
    """Optimizer steps and micro-batches per training step for actor or critic, at prompt length ``p``
    (default ``data.max_prompt_length``; the report passes the one its memory estimate assumes)."""
    w = cfg.actor if role == "actor" else cfg.critic
    n, data = cfg.rollout.n, cfg.data
    minis = max(1, data.train_batch_size // w.ppo_mini_batch_size)
    seqs = w.ppo_mini_batch_size * n // dims.dp
    per_micro = micro_shape(cfg, role, cfg.data.max_prompt_length if p is None else p)[0]
    per_mini = math.ceil(seqs / per_micro)
    return {"optimizer_steps": w.ppo_epochs * minis, "micro_batches_per_optimizer_step": per_mini,
            "micro_batches": w.ppo_epochs * minis * per_mini, "sequences_per_micro_batch": per_micro}  # fmt: skip


def rank_table(dims: ParallelDims, layers: int, limit: int = 16) -> list[dict]:
    """Which rank holds what (megatron-core order: TP fastest, then DP, then PP)."""
    rows = []
    per = layers // dims.pp
    for r in range(min(dims.world_size, limit)):
        tp_r, rest = r % dims.tp, r // dims.tp
        dp_r, pp_r = rest % dims.dp, rest // dims.dp
        holds = [f"layers {pp_r * per}-{(pp_r + 1) * per - 1}"]
        holds += ["embedding"] if pp_r == 0 else []
        holds += ["LM/value head"] if pp_r == dims.pp - 1 else []
        rows.append(
            {"rank": r, "tp": tp_r, "pp": pp_r, "dp": dp_r, "holds": ", ".join(holds) + f" (TP shard {tp_r})"}
        )
    return rows


def prompt_length(cfg: JobConfig) -> tuple[int, str]:
    """The prompt length the estimate assumes: the longest prompt of ``data.train_files`` after the chat
    template and ``data.max_prompt_length`` when the files and the tokenizer can be read, else
    ``data.max_prompt_length`` (the worst case)."""
    limit = cfg.data.max_prompt_length
    if cfg.model.path is None or not cfg.data.train_files:
        return limit, f"data.max_prompt_length={limit}"
    try:
        from transformers import AutoTokenizer

        from megatron_rl.data import PromptDataset

        tok_dir = Path(cfg.model.path)
        tok_dir = (
            tok_dir / "hf_config" if (tok_dir / "hf_config" / "tokenizer_config.json").is_file() else tok_dir
        )
        ds = PromptDataset(cfg.data.train_files, AutoTokenizer.from_pretrained(tok_dir), cfg.data.prompt_key,
                           limit, "left" if cfg.data.truncation == "error" else cfg.data.truncation,
                           cfg.data.apply_chat_template)  # fmt: skip
        longest = max(len(r.prompt_ids) for r in ds.rows)
        return longest, f"the longest of {len(ds.rows)} prompts in data.train_files (limit {limit})"
    except Exception as exc:  # noqa: BLE001 - a planning aid: fall back to the configured limit
        return limit, f"data.max_prompt_length={limit} (could not read the prompts: {type(exc).__name__})"


def report(cfg: JobConfig, dims: ParallelDims) -> dict:
    """Everything ``dry_run`` prints, as a dict; the ``auto`` keys are resolved in ``cfg`` (in place).
    Raises ``ConfigError`` (after filling ``report.last``) when the job cannot fit the GPU."""
    arch, source = read_arch(cfg, dims.tp)
    p, p_how = prompt_length(cfg)
    total, total_how = gpu_memory_bytes(cfg)
    out = {
        "layout": {"world_size": dims.world_size, "tp": dims.tp, "pp": dims.pp, "dp": dims.dp,
                   "generation_tp": cfg.rollout.tensor_model_parallel_size or dims.tp},
        "model": {"source": source, "layers": arch.num_layers, "hidden": arch.hidden_size,
                  "vocab": arch.vocab_size, "padded_vocab": arch.padded_vocab_size, "params": arch.num_params(),
                  "dtype": cfg.model.dtype},
        "ranks": rank_table(dims, arch.num_layers),
        "prompt_length": {"tokens": p, "from": p_how},
        "gpu": {"bytes": total, "from": total_how},
    }  # fmt: skip
    try:
        fitted = plan(cfg, dims, arch, p, total, dry_run=True)
    except ConfigError as err:
        out["memory"], out["refused"] = estimate(cfg, dims, arch, p), str(err)
        raise
    finally:
        report.last = out
    apply_plan(cfg, fitted["chosen"])
    out["auto"] = fitted["notes"]
    out["memory"] = estimate(cfg, dims, arch, p)
    out["batches"] = {"actor": micro_batches(cfg, dims, "actor", p)}
    if cfg.algorithm.adv_estimator == "gae":
        out["batches"]["critic"] = micro_batches(cfg, dims, "critic", p)
    return out


NOTES = {
    "params": "bf16/fp32 weights of every model on the GPU (actor, ref, critic)",
    "grads": "local backend: fp32 main_grad, training only (freed after each optimizer step)",
    "optimizer": "fp32 main params + AdamW moments on the GPU (/ DP with the distributed optimizer, less "
    "the hybrid optimizer's host share) + megatron fp32 grad buffers",
    "optimizer_on_host": "hybrid-device optimizer: the fraction kept in host memory",
    "generation_gathered_weights": "other PP stages' layers at the generation TP, generation only",
    "activations": "one actor micro-batch kept for backward (x micro-batches in flight at PP > 1)",
    "logits": "response-position logits and their gradient (model dtype), one micro-batch",
    "kept_generation": "rollout.keep_cache: the KV cache and the decode graphs' scratch, held through updates",
}


def _size(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB / 10 else f"{b / 2**20:.2f} MiB"


def format_report(r: dict) -> str:
    lay, m = r["layout"], r["model"]
    lines = [f"megatron-rl dry run: world={lay['world_size']} = TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']} "
             f"(generation TP {lay['generation_tp']}, PP folded into DP)",
             f"model: {m['source']}: {m['params'] / 1e9:.2f}B params, {m['layers']} layers, hidden {m['hidden']}, "
             f"vocab {m['vocab']} (padded {m['padded_vocab']}), {m['dtype']}", "ranks:"]  # fmt: skip
    lines += [
        f"  rank {x['rank']:>4}: tp={x['tp']} pp={x['pp']} dp={x['dp']}  {x['holds']}" for x in r["ranks"]
    ]
    if len(r["ranks"]) < lay["world_size"]:
        lines.append(f"  ... ({lay['world_size'] - len(r['ranks'])} more ranks, same pattern)")
    for key, note in r.get("auto", {}).items():
        lines.append(f"{key}: {note}")
    for role, b in r.get("batches", {}).items():
        lines.append(f"{role} per training step: {b['optimizer_steps']} optimizer steps x "
                     f"{b['micro_batches_per_optimizer_step']} micro-batches of {b['sequences_per_micro_batch']} "
                     f"sequences per rank = {b['micro_batches']} micro-batches")  # fmt: skip
    mem, pl = r["memory"], r["prompt_length"]
    lines.append(f"memory per GPU (estimate, {mem['stage']} pipeline stage; models: {', '.join(mem['roles'])}; "
                 f"prompts of {pl['tokens']} tokens: {pl['from']}; GPU: {r['gpu']['from']}):")  # fmt: skip
    for k, v in mem["bytes"].items():
        lines.append(f"  {k:<28} {_size(v):>12}  ({NOTES.get(k, '')})" if NOTES.get(k) or k != "kv_cache" else
                     f"  {k:<28} {_size(v):>12}  ({mem['kv_slots']} slots)")  # fmt: skip
    for phase, v in mem["peaks"].items():
        lines.append(f"  {'peak: ' + phase:<28} {_size(v):>12}")
    lines.append("  (allocated tensors as torch.cuda.max_memory_allocated counts them; the CUDA context and the "
                 "allocator's cache come on top)")  # fmt: skip
    if "refused" in r:
        lines.append(f"DOES NOT FIT: {r['refused']}")
    return "\n".join(lines)


def dry_run(cfg: JobConfig, dims: ParallelDims, rank: int = 0) -> dict:
    """Print the layout, estimate and plan (rank 0) and write ``<output_dir>/dry_run.json``; no training.
    A job that cannot fit is printed, then refused (``ConfigError`` naming the key and a value that fits)."""
    try:
        r = report(cfg, dims)
    finally:
        if rank == 0 and getattr(report, "last", None) is not None:
            print(format_report(report.last), flush=True)
            out = Path(cfg.trainer.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "dry_run.json").write_text(json.dumps(report.last, indent=1, default=str))
    return r
