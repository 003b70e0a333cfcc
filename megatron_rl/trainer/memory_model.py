"""The memory model: allocated bytes per GPU in each phase of a training step, from the config and the
model's shape alone (no process group, no GPU, no weights).

The dry run prints it, ``=auto`` budgets are chosen from it and configurations it says cannot fit are
refused before any weights load (``trainer.memory_plan``). It counts the largest pipeline stage (first or
last, which also hold the embedding / LM head). Per phase:

- training peak = resident state + training-only gradients + max(the activations one micro-batch keeps
  for backward + the log-prob kernel's logits, the optimizer step's temporaries);
- generation peak = resident state (less what the ``*_offload`` keys move to the host while generating)
  + the other pipeline stages' gathered weights + the KV cache + the decode/prefill scratch.
"""

from __future__ import annotations

import math

from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.dims import ParallelDims
from megatron_rl.models.args import ModelArgs
from megatron_rl.models.lora_hf import adapter_params_per_layer
from megatron_rl.rollout.shared_prompts import shared_seq_tokens

BYTES = {"float32": 4, "bfloat16": 2}
GIB = 2**30


def trained_roles(cfg: JobConfig) -> dict[str, str]:
    """Role -> head ("lm" | "value") of every model the job holds on the GPU."""
    roles = {"actor": "lm"}
    # a LoRA actor is its own reference (adapters off): no second copy of the weights
    if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not cfg.actor.lora.enabled:
        roles["ref"] = "lm"
    if cfg.algorithm.adv_estimator == "gae":
        roles["critic"] = "value"
    return roles


def _seq_len(cfg: JobConfig, p: int) -> int:
    return p + cfg.rollout.max_new_tokens


def seq_tokens(cfg: JobConfig, role: str, p: int) -> int:
    """Tokens one sequence runs in a ``role`` update micro-batch: prompt + response, or with
    ``share_prompts`` its response plus its share of the group's one prompt copy (``shared_seq_tokens``)."""
    if getattr(cfg, role).share_prompts is True:  # "auto": resolved by the memory plan before this counts
        return shared_seq_tokens(p, cfg.rollout.max_new_tokens, cfg.rollout.n)
    return _seq_len(cfg, p)


def micro_seqs(cfg: JobConfig, role: str, seq_len: int, budget: int | None = None) -> int:
    """Sequences in one micro-batch of ``role``: the fixed count, or (use_dynamic_bsz) as many sequences
    of ``seq_len`` tokens as the token budget (``budget``, default the configured one) holds."""
    w = getattr(cfg, role)
    if w.use_dynamic_bsz:
        b = w.ppo_max_token_len_per_gpu if budget is None else budget
        if b == "auto":  # unresolved (a planning call before the search): one sequence
            b = seq_len
        return max(1, min(int(b) // seq_len, max(1, w.ppo_mini_batch_size * cfg.rollout.n)))
    return w.ppo_micro_batch_size_per_gpu


def micro_shape(cfg: JobConfig, role: str, p: int, budget: int | None = None) -> tuple[int, int]:
    """(sequences, tokens) of the largest ``role`` update micro-batch at prompt length ``p``. Shared prompts
    (``share_prompts``, dynamic batches): the split (``rollout.shared_prompts.shared_groups``) packs whole
    GRPO groups, each ``p + n r`` tokens, and splits a group only when it alone exceeds the budget (row by
    row, its prompt in each part), so a budget between two multiples of the group holds the smaller number
    of groups. Counting ``budget // (r + p / n)`` sequences instead put the Llama-3.1-8B update 15.8% over
    its measured peak (session 8: 15 sequences counted at budget 8160, one group of 8 held)."""
    w, r, n = getattr(cfg, role), cfg.rollout.max_new_tokens, cfg.rollout.n
    s = seq_tokens(cfg, role, p)
    if w.share_prompts is not True or not w.use_dynamic_bsz or s == _seq_len(cfg, p):
        seqs = micro_seqs(cfg, role, s, budget)
        return seqs, seqs * s
    b = w.ppo_max_token_len_per_gpu if budget is None else budget
    b = p + r if b == "auto" else int(b)  # unresolved (a planning call before the search): one sequence
    group = p + n * r
    seqs = n * (b // group) if b >= group else max(1, (b - p) // r)
    seqs = min(seqs, max(1, w.ppo_mini_batch_size * n))
    whole, part = divmod(seqs, n)
    return seqs, whole * group + (p + part * r if part else 0)


def scored_rows(cfg: JobConfig, role: str, p: int) -> int:
    """The LM-head rows (sequences x response length) the model counts for one ``role`` micro-batch at
    prompt length ``p``: the split's bound, so that micro-batches of shorter prompts (more sequences within
    the same token budget) never score more rows than the plan sized the logits for."""
    return micro_shape(cfg, role, p)[0] * cfg.rollout.max_new_tokens


def layer_activation_bytes_per_token(cfg: JobConfig, a: ModelArgs, tp: int, role: str) -> float:
    """Bytes one token keeps for backward in one local-spec layer: the two norm inputs and outputs and
    attention-out's input (5h), the SDPA inputs and output (q, k, v, out: 2q + kv; flash/cuDNN keep no
    [T, T] scores), fc1's output and fc2's input (3f: the fused SwiGLU keeps no SiLU output). The h terms
    split over TP only with sequence parallelism. Selective recomputation drops what its modules keep:
    mlp the 3f, layernorm the two norm outputs; core_attn nothing measurable (the attention kernel keeps
    no scores)."""
    w = getattr(cfg, role)
    dtype_b = BYTES[cfg.model.dtype]
    sp = tp if cfg.parallel.sequence_parallel else 1
    h, q, kv = a.hidden_size, a.num_attention_heads * a.head_dim, 2 * a.num_query_groups * a.head_dim
    norm_out, mlp = 2 * h / sp, 3 * a.ffn_hidden_size / tp
    if w.recompute_granularity == "selective":
        norm_out = 0.0 if "layernorm" in w.recompute_modules else norm_out
        mlp = 0.0 if "mlp" in w.recompute_modules else mlp
    return (3 * h / sp + norm_out + (2 * q + kv) / tp + mlp) * dtype_b


def activation_bytes(
    cfg: JobConfig, a: ModelArgs, dims: ParallelDims, role: str, p: int, budget=None
) -> float:
    """What one micro-batch's layers keep for backward on one stage, times the micro-batches in flight
    (1F1B: min(pp, micro-batches)). Full recomputation keeps each unit's input ([tokens, h]) and, during
    backward, one unit's activations (uniform: recompute_num_layers layers; block: the layers past the
    first recompute_num_layers, plus one recomputed layer)."""
    w = getattr(cfg, role)
    s = seq_tokens(cfg, role, p)
    seqs, tokens = micro_shape(cfg, role, p, budget)
    layers = a.num_layers // dims.pp
    per_layer = layer_activation_bytes_per_token(cfg, a, dims.tp, role)
    if s != _seq_len(cfg, p):  # shared prompts: attention keeps the gathered key segments (prompt + response)
        n, r = cfg.rollout.n, cfg.rollout.max_new_tokens
        keys_per_token = (n * (p + r) + p) / (n * r + p)
        per_layer += keys_per_token * 2 * a.num_query_groups * a.head_dim / dims.tp * BYTES[cfg.model.dtype]
    h_in = a.hidden_size / (dims.tp if cfg.parallel.sequence_parallel else 1) * BYTES[cfg.model.dtype]
    if w.recompute_granularity == "full" and w.recompute_method == "uniform":
        n = w.recompute_num_layers
        kept = math.ceil(layers / n) * h_in + n * per_layer
    elif w.recompute_granularity == "full":  # block
        n = min(w.recompute_num_layers, layers)
        kept = n * h_in + (layers - n + (1 if n else 0)) * per_layer
    else:
        kept = layers * per_layer
    seqs_per_rank = max(1, cfg.data.train_batch_size * cfg.rollout.n // dims.dp)
    n_micro = max(1, math.ceil(seqs_per_rank / seqs))
    return tokens * kept * min(dims.pp, n_micro)


def logit_bytes(cfg: JobConfig, a: ModelArgs, dims: ParallelDims, p: int, budget=None) -> float:
    """The actor's LM-head logits of one micro-batch during the log-prob kernel's backward: the logits it
    keeps and their gradient, both in the model dtype (the compiled fused kernel keeps no fp32 [rows, V]
    tensor; its eager fallback works in chunks of 1024 rows); at the response-scoring positions only (the
    trainer's default), at every position with sequence parallelism.

    Measured (session 4, one H200): a third pair of bytes per logit, counted before, put the 0.5B update
    (86 sequences, 44k logit rows) 23% over its peak; with two, every size from 0.5B to 8B is within 3%.
    ``rollout.exact_logprobs`` holds two more (its Triton LM head's output beside the compiled kernel's
    copy, and the exact log-softmax's input): measured (session 5, 0.5B, 56k logit rows) 136.0 GiB allocated
    and 15.9 GiB (one more logits tensor) asked for where two copies planned 119.9 GiB."""
    s = seq_tokens(cfg, "actor", p)
    b = micro_shape(cfg, "actor", p, budget)[0]
    rows = b * (s if cfg.parallel.sequence_parallel else cfg.rollout.max_new_tokens)
    copies = 4 if cfg.rollout.exact_logprobs else 2
    return rows * a.with_tp(dims.tp).padded_vocab_size / dims.tp * copies * BYTES[cfg.model.dtype]


def gen_slots(cfg: JobConfig, dims: ParallelDims, max_num_seqs: int | None = None) -> tuple[int, int]:
    """(sequences per generation rank, KV-cache slots = sequences decoded together)."""
    r = cfg.rollout
    tp_g = r.tensor_model_parallel_size or dims.tp
    gen_ranks = dims.dp * dims.pp * (dims.tp // tp_g)  # PP folded into DP, micro-DP of size TP/TP_g
    seqs = math.ceil(cfg.data.train_batch_size * r.n / gen_ranks)
    limit = r.max_num_seqs if max_num_seqs is None else max_num_seqs
    limit = seqs if limit == "auto" else int(limit)  # unresolved auto: every sequence at once
    return seqs, max(1, min(seqs, limit))


def kv_cache_bytes(cfg: JobConfig, a: ModelArgs, dims: ParallelDims, p: int, slots: int) -> float:
    r = cfg.rollout
    per_token = a.kv_bytes_per_token(r.tensor_model_parallel_size or dims.tp, BYTES[cfg.model.dtype])
    if r.kv_cache_tokens:
        return r.kv_cache_tokens * per_token
    return slots * _seq_len(cfg, p) * per_token


def decode_temporaries(cfg: JobConfig, a: ModelArgs, dims: ParallelDims, slots: int) -> float:
    """Generation scratch: fp32 logits of every slot with the sampling noise and log-softmax beside them
    (3 x [slots, V] fp32), or one prefill batch's largest layer temporaries, whichever is larger."""
    tp_g = cfg.rollout.tensor_model_parallel_size or dims.tp
    sampling = 3 * slots * a.vocab_size * 4
    prefill = cfg.rollout.max_prefill_tokens * (4 * a.ffn_hidden_size / tp_g + 4 * a.hidden_size)
    return max(sampling, prefill * BYTES[cfg.model.dtype])


def optimizer_state(cfg: JobConfig, role: str, n: float, dp: int) -> dict[str, float]:
    """GPU bytes of one trained role's optimizer side: ``resident`` (held all run), ``train_only`` (held
    only while training), ``offloaded_while_generating`` (resident bytes the *_offload keys move to the
    host while generating) and ``host`` (kept on the host throughout by the hybrid-device optimizer)."""
    o = getattr(cfg, role).optim
    main_b = 4 if BYTES[cfg.model.dtype] != 4 else 0  # fp32 main params of bf16 weights
    shard = dp if o.backend == "megatron" and o.use_distributed_optimizer else 1
    on_host = (
        getattr(o, "optimizer_offload_fraction", 1.0) if getattr(o, "optimizer_cpu_offload", False) else 0.0
    )
    main, moments = n * main_b / shard * (1 - on_host), n * 8 / shard * (1 - on_host)
    if o.backend == "megatron":  # fp32 grad buffers for the whole run
        grads, train_only = n * 4, 0.0
    else:  # fp32 main_grad accumulated over the micro-batches, freed after each optimizer step
        grads, train_only = 0.0, n * 4
    away = main * getattr(o, "param_offload", False) + moments * getattr(o, "optimizer_offload", False)
    away += grads * getattr(o, "grad_offload", False)
    return {"resident": main + moments + grads, "train_only": train_only,
            "offloaded_while_generating": away, "host": n * (main_b + 8) / shard * on_host,
            "step_temporaries": n * 4 / shard * (1 - on_host) if main_b else 0.0}  # fmt: skip


def _trained_params(cfg: JobConfig, a: ModelArgs, dims: ParallelDims, role: str, stage_total: int) -> float:
    """Parameters of ``role`` on this rank that have gradients and optimizer state: all of them, or with
    ``<role>.lora`` the adapters (+ a critic's value head)."""
    lora = getattr(cfg, role).lora
    if not lora.enabled:
        return stage_total
    per = adapter_params_per_layer(a, lora.target_modules, lora.rank, dims.tp)["adapters"]
    return per * a.num_layers // dims.pp + (a.hidden_size if role == "critic" else 0)


def _lora_merged_bytes(cfg: JobConfig, a: ModelArgs, dims: ParallelDims, dtype_b: int) -> float:
    """A LoRA actor generates on merged copies of its adapted weights (the base stays untouched)."""
    lora = cfg.actor.lora
    if not lora.enabled:
        return 0.0
    per = adapter_params_per_layer(a, lora.target_modules, lora.rank, dims.tp)["adapted"]
    return per * (a.num_layers // dims.pp) * dtype_b


def estimate(cfg: JobConfig, dims: ParallelDims, a: ModelArgs, p: int, budgets: dict | None = None) -> dict:
    """Bytes per GPU by category and per phase. ``p``: the prompt length assumed; ``budgets``: values to
    use instead of the configured ``actor`` / ``critic`` token budgets and ``rollout`` KV slots (the
    ``=auto`` search), e.g. {"actor": 24576, "critic": 16384, "max_num_seqs": 512}."""
    budgets = budgets or {}
    dtype_b = BYTES[cfg.model.dtype]
    roles = trained_roles(cfg)
    counts = {r: a.stage_params(dims.tp, dims.pp, head) for r, head in roles.items()}
    worst = max(("first", "last"), key=lambda s: sum(c[s] for c in counts.values()))
    trained = {r: _trained_params(cfg, a, dims, r, counts[r][worst]) for r in roles if r != "ref"}
    state = {r: optimizer_state(cfg, r, trained[r], dims.dp) for r in trained}
    tp_g = cfg.rollout.tensor_model_parallel_size or dims.tp
    _, slots = gen_slots(cfg, dims, budgets.get("max_num_seqs"))
    act = {r: activation_bytes(cfg, a, dims, r, p, budgets.get(r)) for r in state}
    mem = {
        "params": sum(c[worst] for c in counts.values()) * dtype_b,
        "grads": sum(s["train_only"] for s in state.values()),
        "optimizer": sum(s["resident"] for s in state.values()),
        "optimizer_on_host": sum(s["host"] for s in state.values()),
        "generation_gathered_weights": max(0.0, a.stage_params(tp_g, 1)["first"] - counts["actor"][worst])
        * dtype_b
        + _lora_merged_bytes(cfg, a, dims, dtype_b),
        "kv_cache": kv_cache_bytes(cfg, a, dims, p, slots),
        "generation_temporaries": decode_temporaries(cfg, a, dims, slots),
        "activations": act["actor"],
        "logits": logit_bytes(cfg, a, dims, p, budgets.get("actor")),
    }
    # rollout.keep_cache: the cache and the decode graphs' pool (counted as the decode scratch) stay
    # allocated through the updates
    mem["kept_generation"] = (
        mem["kv_cache"] + mem["generation_temporaries"] if cfg.rollout.keep_cache is True else 0.0
    )
    resident = mem["params"] + mem["optimizer"]
    step_temp = max(s["step_temporaries"] for s in state.values())
    train = resident + mem["grads"] + mem["kept_generation"]
    peaks = {"actor_update": train + max(act["actor"] + mem["logits"], step_temp)}
    if "critic" in act:
        peaks["critic_update"] = train + max(act["critic"], step_temp)
    away = sum(s["offloaded_while_generating"] for s in state.values())
    gen = mem["generation_gathered_weights"] + mem["kv_cache"] + mem["generation_temporaries"]
    peaks["generation"] = resident - away + gen
    return {"bytes": mem, "params_per_gpu": sum(c[worst] for c in counts.values()), "stage": worst,
            "roles": list(roles), "kv_slots": slots, "resident": resident, "peaks": peaks,
            "peak_train": max(v for k, v in peaks.items() if k != "generation"),
            "peak_generate": peaks["generation"], "peak": max(peaks.values())}  # fmt: skip
