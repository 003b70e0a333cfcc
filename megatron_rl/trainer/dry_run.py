"""`trainer.dry_run=true`: print the resolved layout and a per-GPU memory estimate, then exit.

Works from the HF config.json alone (or the built-in tiny model's settings), before any process group,
model or GPU memory exists. The estimate counts the largest pipeline stage (first or last, which also hold
the embedding / LM head) and says what each number assumes; it is a planning aid, not a measurement.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.dims import ParallelDims

BYTES = {"float32": 4, "bfloat16": 2}
GIB = 2**30


@dataclass(frozen=True)
class Arch:
    """The numbers the estimate needs from an HF config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, c: dict) -> Arch:
        heads = int(c["num_attention_heads"])
        return cls(
            layers=int(c["num_hidden_layers"]), hidden=int(c["hidden_size"]), heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            ffn=int(c["intermediate_size"]), vocab=int(c["vocab_size"]),
            tied=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
        )  # fmt: skip


def read_arch(cfg: JobConfig) -> tuple[Arch, str]:
    """(architecture, where it came from): model.path's config.json, or the built-in tiny model."""
    m = cfg.model
    if m.path is None:
        from megatron_rl.tasks.last_digit import builtin_tokenizer

        vocab = len(builtin_tokenizer(builtin_data=cfg.data.train_files is None))
        hf = dict(num_hidden_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                  num_key_value_heads=m.num_key_value_heads, intermediate_size=m.ffn_hidden_size, vocab_size=vocab,
                  tie_word_embeddings=True, model_type="qwen2")  # fmt: skip
        return Arch.from_hf(hf), "built-in tiny model (model.path unset)"
    for cand in (Path(m.path) / "config.json", Path(m.path) / "hf_config" / "config.json"):
        if cand.is_file():
            return Arch.from_hf(json.loads(cand.read_text())), str(cand)
    raise FileNotFoundError(f"model.path={m.path!r} has no config.json (looked in {m.path} and "
                            f"{m.path}/hf_config); point model.path at an HF model directory")  # fmt: skip


def padded_vocab(vocab: int, tp: int) -> int:
    mult = 128 * tp
    return math.ceil(vocab / mult) * mult


def layer_params(a: Arch, tp: int) -> float:
    """Parameters of one transformer layer held by one TP rank (norms replicated)."""
    qkv = (
        a.hidden * (a.heads + 2 * a.kv_heads) * a.head_dim
        + (a.heads + 2 * a.kv_heads) * a.head_dim * a.qkv_bias
    )
    proj = a.heads * a.head_dim * a.hidden
    mlp = 3 * a.ffn * a.hidden  # swiglu: fc1 = gate + up, fc2
    return (qkv + proj + mlp) / tp + 2 * a.hidden


def stage_params(a: Arch, tp: int, pp: int, head: str) -> dict[str, float]:
    """Params on the first and on the last PP stage of one model; head: lm | value."""
    body = layer_params(a, tp) * a.layers / pp
    emb = padded_vocab(a.vocab, tp) * a.hidden / tp
    out = emb if head == "lm" and (not a.tied or pp > 1) else (a.hidden if head == "value" else 0)
    first = body + emb + (out + a.hidden if pp == 1 else 0)
    last = body + (out + a.hidden if pp > 1 else 0)
    return {"first": first, "last": last}


def micro_batches(cfg: JobConfig, dims: ParallelDims, role: str) -> dict[str, int]:
    """Optimizer steps and micro-batches per training step for actor or critic."""
    w = cfg.actor if role == "actor" else cfg.critic
    n, data = cfg.rollout.n, cfg.data
    minis = max(1, data.train_batch_size // w.ppo_mini_batch_size)
    seqs = w.ppo_mini_batch_size * n // dims.dp
    per_mini = math.ceil(seqs / w.ppo_micro_batch_size_per_gpu)
    return {"optimizer_steps": w.ppo_epochs * minis, "micro_batches_per_optimizer_step": per_mini,
            "micro_batches": w.ppo_epochs * minis * per_mini, "sequences_per_micro_batch": w.ppo_micro_batch_size_per_gpu}  # fmt: skip


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


def _activation_bytes(
    cfg: JobConfig, a: Arch, dims: ParallelDims, n_micro: int, dtype_b: int, p: int
) -> float:
    """Tensors the local-spec layers keep for backward in one training micro-batch, on the first stage,
    times min(pp, micro-batches) in flight (1F1B). Per token and layer (bytes): the two norm inputs and
    outputs and attention-out's input (5h), the SDPA inputs and output (q, k, v, out: 2q + kv; flash/cuDNN
    keep no [T, T] scores), fc1's output and fc2's input (3f: the fused SwiGLU of ``kernels.swiglu``, on by
    default on GPU, keeps no SiLU output; unfused it is 4f); the h terms are split over TP only with
    sequence parallelism. ``p``: the prompt length assumed."""
    s = p + cfg.rollout.max_new_tokens
    b, tp, h = _micro_seqs(cfg, s), dims.tp, a.hidden
    q, kv = a.heads * a.head_dim, 2 * a.kv_heads * a.head_dim
    sp = tp if cfg.parallel.sequence_parallel else 1
    per_token_layer = (5 * h / sp + (2 * q + kv + 3 * a.ffn) / tp) * dtype_b
    in_flight = min(dims.pp, max(1, n_micro))
    return s * b * per_token_layer * a.layers / dims.pp * in_flight


def _micro_seqs(cfg: JobConfig, seq_len: int) -> float:
    """Sequences in one actor micro-batch: the fixed count, or (actor.use_dynamic_bsz) as many sequences
    of ``seq_len`` tokens as the token budget holds."""
    if cfg.actor.use_dynamic_bsz:
        return max(1, cfg.actor.ppo_max_token_len_per_gpu // seq_len)
    return cfg.actor.ppo_micro_batch_size_per_gpu


def _logit_bytes(cfg: JobConfig, a: Arch, dims: ParallelDims, dtype_b: int, p: int) -> float:
    """The LM head's logits of one micro-batch kept for the fused log-prob kernel's backward, plus their
    gradient: at the response positions only (the trainer's default), at every position with sequence
    parallelism."""
    b = _micro_seqs(cfg, p + cfg.rollout.max_new_tokens)
    rows = b * cfg.rollout.max_new_tokens
    if cfg.parallel.sequence_parallel:
        rows = b * (p + cfg.rollout.max_new_tokens)
    return 2 * rows * padded_vocab(a.vocab, dims.tp) / dims.tp * dtype_b


def _gen_slots(cfg: JobConfig, dims: ParallelDims) -> tuple[int, int]:
    """(sequences per generation rank, KV-cache slots = sequences decoded together)."""
    r = cfg.rollout
    tp_g = r.tensor_model_parallel_size or dims.tp
    gen_ranks = dims.dp * dims.pp * (dims.tp // tp_g)  # PP folded into DP, micro-DP of size TP/TP_g
    seqs = math.ceil(cfg.data.train_batch_size * r.n / gen_ranks)
    return seqs, max(1, min(seqs, r.max_num_seqs))


def _kv_cache(cfg: JobConfig, a: Arch, dims: ParallelDims, dtype_b: int, p: int) -> tuple[float, str]:
    r = cfg.rollout
    tp_g = r.tensor_model_parallel_size or dims.tp
    per_token = a.layers * 2 * max(1, a.kv_heads // tp_g) * a.head_dim * dtype_b
    max_len = p + r.max_new_tokens
    if r.kv_cache_tokens:
        return r.kv_cache_tokens * per_token, "rollout.kv_cache_tokens"
    seqs, slots = _gen_slots(cfg, dims)
    how = f"sized from the batch: {slots} slots ({seqs} sequences, rollout.max_num_seqs={r.max_num_seqs})"
    how += f" x {max_len} tokens; on GPU capped at rollout.gpu_memory_utilization={r.gpu_memory_utilization}"
    return slots * max_len * per_token, how + " of free memory"


def _decode_temporaries(cfg: JobConfig, a: Arch, dims: ParallelDims, dtype_b: int) -> float:
    """Generation scratch: fp32 logits of every slot with the sampling noise and log-softmax beside them
    (3 x [slots, V] fp32), or one prefill batch's largest layer temporaries, whichever is larger."""
    _, slots = _gen_slots(cfg, dims)
    tp_g = cfg.rollout.tensor_model_parallel_size or dims.tp
    sampling = 3 * slots * a.vocab * 4
    prefill = cfg.rollout.max_prefill_tokens * (4 * a.ffn / tp_g + 4 * a.hidden) * dtype_b
    return max(sampling, prefill)


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


def estimate(cfg: JobConfig, dims: ParallelDims, a: Arch, p: int | None = None) -> dict:
    """Memory per GPU in bytes by category (the largest stage), plus the assumptions. ``p``: prompt
    length (default ``data.max_prompt_length``)."""
    p = cfg.data.max_prompt_length if p is None else p
    dtype_b = BYTES[cfg.model.dtype]
    roles = {"actor": "lm"}
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        roles["ref"] = "lm"
    if cfg.algorithm.adv_estimator == "gae":
        roles["critic"] = "value"
    counts = {r: stage_params(a, dims.tp, dims.pp, head) for r, head in roles.items()}
    worst = max(("first", "last"), key=lambda s: sum(c[s] for c in counts.values()))
    n_all = sum(c[worst] for c in counts.values())
    n_trained = sum(c[worst] for r, c in counts.items() if r != "ref")
    main_b = 4 if dtype_b != 4 else 0  # fp32 main copies of bf16 params
    grads_b, opt_b, resident_grads = 0.0, 0.0, 0.0
    for role in (r for r in counts if r != "ref"):
        optim, n = getattr(cfg, role).optim, counts[role][worst]
        if optim.backend == "megatron":  # fp32 grad buffers, allocated for the whole run
            resident_grads += n * 4
            opt_b += n * (8 + main_b) / (dims.dp if optim.use_distributed_optimizer else 1)
        else:  # bf16 .grad during training only
            grads_b += n * dtype_b
            opt_b += n * (8 + main_b)
    tp_g = cfg.rollout.tensor_model_parallel_size or dims.tp
    gathered = stage_params(a, tp_g, 1, "lm")["first"] - counts["actor"][worst]
    kv, kv_how = _kv_cache(cfg, a, dims, dtype_b, p)
    n_micro = micro_batches(cfg, dims, "actor")["micro_batches_per_optimizer_step"]
    mem = {
        "params": n_all * dtype_b,
        "grads": grads_b + resident_grads,
        "optimizer": opt_b,
        "generation_gathered_weights": max(0.0, gathered) * dtype_b,
        "kv_cache": kv,
        "generation_temporaries": _decode_temporaries(cfg, a, dims, dtype_b),
        "activations": _activation_bytes(cfg, a, dims, n_micro, dtype_b, p),
        "logits": _logit_bytes(cfg, a, dims, dtype_b, p),
    }
    notes = {
        "stage": f"{worst} pipeline stage (the larger one)", "models": ", ".join(roles),
        "grads": "local backend: training only (freed after each optimizer step); megatron backend: fp32 "
        "buffers held throughout",
        "optimizer": "AdamW exp_avg + exp_avg_sq in fp32" + (" + fp32 main params" if main_b else "")
        + " (/ DP with the distributed optimizer)",
        "kv_cache": kv_how,
        "generation_gathered_weights": f"other PP stages' layers at TP_g={tp_g}, held during generation only",
        "activations": f"one micro-batch of {p} + {cfg.rollout.max_new_tokens} tokens, kept for backward",
        "logits": "response-position logits kept by the log-prob kernel + their gradient, one micro-batch",
    }  # fmt: skip
    resident = mem["params"] + mem["optimizer"] + resident_grads
    step_temp = n_trained * 4 if main_b else 0  # fp32 copies of the grads inside the optimizer step
    peak_train = resident + grads_b + max(mem["activations"] + mem["logits"], step_temp)
    peak_generate = resident + mem["generation_gathered_weights"] + kv + mem["generation_temporaries"]
    return {"bytes": mem, "params_per_gpu": n_all, "notes": notes,
            "peak_train": peak_train, "peak_generate": peak_generate,
            "peak": max(peak_train, peak_generate)}  # fmt: skip


def report(cfg: JobConfig, dims: ParallelDims) -> dict:
    """Everything ``dry_run`` prints, as a dict."""
    arch, source = read_arch(cfg)
    p, p_how = prompt_length(cfg)
    out = {
        "layout": {"world_size": dims.world_size, "tp": dims.tp, "pp": dims.pp, "dp": dims.dp,
                   "generation_tp": cfg.rollout.tensor_model_parallel_size or dims.tp},
        "model": {"source": source, **arch.__dict__, "padded_vocab": padded_vocab(arch.vocab, dims.tp), "dtype": cfg.model.dtype},
        "ranks": rank_table(dims, arch.layers),
        "batches": {"actor": micro_batches(cfg, dims, "actor")},
        "memory": estimate(cfg, dims, arch, p),
        "prompt_length": {"tokens": p, "from": p_how},
    }  # fmt: skip
    if cfg.algorithm.adv_estimator == "gae":
        out["batches"]["critic"] = micro_batches(cfg, dims, "critic")
    return out


def _size(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB / 10 else f"{b / 2**20:.2f} MiB"


def format_report(r: dict) -> str:
    lay, mem = r["layout"], r["memory"]
    lines = [f"megatron-rl dry run: world={lay['world_size']} = TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']} "
             f"(generation TP {lay['generation_tp']}, PP folded into DP)",
             f"model: {r['model']['source']}: {r['model']['layers']} layers, hidden {r['model']['hidden']}, "
             f"vocab {r['model']['vocab']} (padded {r['model']['padded_vocab']}), {r['model']['dtype']}", "ranks:"]  # fmt: skip
    lines += [
        f"  rank {x['rank']:>4}: tp={x['tp']} pp={x['pp']} dp={x['dp']}  {x['holds']}" for x in r["ranks"]
    ]
    if len(r["ranks"]) < lay["world_size"]:
        lines.append(f"  ... ({lay['world_size'] - len(r['ranks'])} more ranks, same pattern)")
    for role, b in r["batches"].items():
        lines.append(f"{role} per training step: {b['optimizer_steps']} optimizer steps x "
                     f"{b['micro_batches_per_optimizer_step']} micro-batches of {b['sequences_per_micro_batch']} "
                     f"sequences per rank = {b['micro_batches']} micro-batches")  # fmt: skip
    pl = r["prompt_length"]
    lines.append(f"memory per GPU (estimate, {mem['notes']['stage']}; models: {mem['notes']['models']}; "
                 f"prompts of {pl['tokens']} tokens: {pl['from']}):")  # fmt: skip
    for k, v in mem["bytes"].items():
        note = mem["notes"].get(k)
        lines.append(f"  {k:<28} {_size(v):>12}" + (f"  ({note})" if note else ""))
    lines.append(f"  {'peak during training':<28} {_size(mem['peak_train']):>12}")
    lines.append(f"  {'peak during generation':<28} {_size(mem['peak_generate']):>12}")
    lines.append("  (allocated tensors as torch.cuda.max_memory_allocated counts them; the CUDA context and the "
                 "allocator's cache come on top)")  # fmt: skip
    return "\n".join(lines)


def dry_run(cfg: JobConfig, dims: ParallelDims, rank: int = 0) -> dict:
    """Print the layout and memory estimate (rank 0) and write ``<output_dir>/dry_run.json``; no training."""
    r = report(cfg, dims)
    if rank == 0:
        print(format_report(r), flush=True)
        out = Path(cfg.trainer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dry_run.json").write_text(json.dumps(r, indent=1))
    return r
