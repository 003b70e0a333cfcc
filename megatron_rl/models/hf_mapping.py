"""Pure HF <-> megatron-core weight mapping (no process groups): one (TP rank, PP rank) shard at a time.

Facts (DESIGN.md): qkv rows are interleaved per query group (q heads of group g, then k[g], then v[g]) and
the TP split is a plain chunk on dim 0; fc1 at TP rank i is cat(gate_i, up_i); column-parallel layers
(qkv, fc1, embedding, output layer) split dim 0, row-parallel (linear_proj, fc2) split dim 1; norms are
replicated; vocab rows are zero-padded to ``padded_vocab_size``. Megatron names here are the local spec's
with layer indices local to the PP stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rl.models.args import ModelArgs

# reader(hf_name, rows=slice|None, cols=slice|None) -> Tensor
Reader = Callable[..., torch.Tensor]
VALUE_HEAD = "score.weight"
# Transformer Engine spec fuses the pre-attention / pre-MLP norms into the following linear layers.
TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def layer_range(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the layers held by ``pp_rank`` (even split, as megatron-core's default)."""
    if num_layers % pp:
        raise ValueError(f"num_layers={num_layers} is not divisible by PP={pp}; choose a PP that divides it")
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _check_tp(args: ModelArgs, tp: int) -> None:
    if args.num_query_groups % tp or args.num_attention_heads % tp or args.ffn_hidden_size % tp:
        raise ValueError(
            f"TP={tp} must divide num_key_value_heads={args.num_query_groups}, num_attention_heads="
            f"{args.num_attention_heads} and intermediate_size={args.ffn_hidden_size}; choose a smaller TP"
        )


def _qkv_shard(read: Reader, args: ModelArgs, prefix: str, suffix: str, tp: int, r: int) -> torch.Tensor:
    """qkv weight [(H+2G)/tp*D, h] or bias [(H+2G)/tp*D] of TP rank r, interleaved per query group."""
    d, gpr = args.head_dim, args.num_query_groups // tp
    qpg = args.num_attention_heads // args.num_query_groups
    g0, g1 = r * gpr, (r + 1) * gpr
    q = read(f"{prefix}self_attn.q_proj.{suffix}", rows=slice(g0 * qpg * d, g1 * qpg * d))
    k = read(f"{prefix}self_attn.k_proj.{suffix}", rows=slice(g0 * d, g1 * d))
    v = read(f"{prefix}self_attn.v_proj.{suffix}", rows=slice(g0 * d, g1 * d))
    rest = q.shape[1:]
    parts = [q.reshape(gpr, qpg * d, *rest), k.reshape(gpr, d, *rest), v.reshape(gpr, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)  # [G/tp*(qpg+2)*D, (h)]


def _vocab_rows(read: Reader, name: str, args: ModelArgs, tp: int, r: int) -> torch.Tensor:
    """Rows [r*Vp/tp, (r+1)*Vp/tp) of a [V, h] matrix, zero rows past V."""
    per = args.padded_vocab_size // tp
    lo, hi = r * per, (r + 1) * per
    real = read(name, rows=slice(min(lo, args.vocab_size), min(hi, args.vocab_size)))
    pad = torch.zeros(per - real.shape[0], real.shape[1], dtype=real.dtype)
    return torch.cat([real, pad])  # [Vp/tp, h]


def _layer_shard(read: Reader, args: ModelArgs, i: int, tp: int, r: int) -> dict[str, torch.Tensor]:
    p = _hf_layer(i)
    ffn, h = args.ffn_hidden_size // tp, args.num_attention_heads * args.head_dim // tp
    out = {
        "input_layernorm.weight": read(f"{p}input_layernorm.weight"),
        "self_attention.linear_qkv.weight": _qkv_shard(read, args, p, "weight", tp, r),
        "self_attention.linear_proj.weight": read(
            f"{p}self_attn.o_proj.weight", cols=slice(r * h, (r + 1) * h)
        ),
        "pre_mlp_layernorm.weight": read(f"{p}post_attention_layernorm.weight"),
        "mlp.linear_fc1.weight": torch.cat(
            [read(f"{p}mlp.{n}_proj.weight", rows=slice(r * ffn, (r + 1) * ffn)) for n in ("gate", "up")]
        ),  # [2*ffn/tp, h]
        "mlp.linear_fc2.weight": read(f"{p}mlp.down_proj.weight", cols=slice(r * ffn, (r + 1) * ffn)),
    }
    if args.qkv_bias:
        out["self_attention.linear_qkv.bias"] = _qkv_shard(read, args, p, "bias", tp, r)
    if args.qk_norm:
        out["self_attention.q_layernorm.weight"] = read(f"{p}self_attn.q_norm.weight")
        out["self_attention.k_layernorm.weight"] = read(f"{p}self_attn.k_norm.weight")
    return out


def megatron_shard_from_hf(
    read: Reader,
    args: ModelArgs,
    *,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    role: str = "actor",
    has_value_head: bool = False,
) -> dict[str, torch.Tensor]:
    """The megatron state dict (local layer indices) of one (tp_rank, pp_rank) shard, read from HF names.

    For critic/reward the value head ``output_layer.weight`` comes from ``score.weight`` when
    ``has_value_head`` (a SequenceClassification checkpoint); otherwise it is left to its init.
    """
    _check_tp(args, tp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: dict[str, torch.Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = _vocab_rows(
            read, "model.embed_tokens.weight", args, tp, tp_rank
        )
    for local, i in enumerate(layer_range(args.num_layers, pp, pp_rank)):
        for name, t in _layer_shard(read, args, i, tp, tp_rank).items():
            out[f"decoder.layers.{local}.{name}"] = t
    if last:
        out["decoder.final_layernorm.weight"] = read("model.norm.weight")
        if role in ("critic", "reward"):
            if has_value_head:
                out["output_layer.weight"] = read(VALUE_HEAD)
        elif not args.tie_word_embeddings:
            out["output_layer.weight"] = _vocab_rows(read, "lm_head.weight", args, tp, tp_rank)
        elif not first:  # tied, PP>1: the last stage keeps its own copy of the embedding
            out["output_layer.weight"] = _vocab_rows(read, "model.embed_tokens.weight", args, tp, tp_rank)
    return out


def _cat(shards: list[dict], key: str, dim: int) -> torch.Tensor:
    return torch.cat([s[key] for s in shards], dim=dim)


def _split_qkv(full: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of the per-group interleave: full [(H+2G)*D, (h)] -> q [H*D, (h)], k, v [G*D, (h)]."""
    g, d = args.num_query_groups, args.head_dim
    qpg = args.num_attention_heads // g
    rest = full.shape[1:]
    grouped = full.reshape(g, qpg + 2, d, *rest)  # [G, qpg+2, D, (h)]
    q = grouped[:, :qpg].reshape(-1, *rest)
    return q, grouped[:, qpg].reshape(-1, *rest), grouped[:, qpg + 1].reshape(-1, *rest)


def _layer_to_hf(tps: list[dict], pre: str, args: ModelArgs, out: dict, hf: str) -> None:
    """Merge one layer's TP shards (keys prefixed ``pre``) into HF tensors under prefix ``hf``."""
    t0 = tps[0]
    out[f"{hf}input_layernorm.weight"] = t0[f"{pre}input_layernorm.weight"]
    out[f"{hf}post_attention_layernorm.weight"] = t0[f"{pre}pre_mlp_layernorm.weight"]
    for suffix in ("weight", "bias") if args.qkv_bias else ("weight",):
        q, k, v = _split_qkv(_cat(tps, f"{pre}self_attention.linear_qkv.{suffix}", 0), args)
        for n, t in (("q", q), ("k", k), ("v", v)):
            out[f"{hf}self_attn.{n}_proj.{suffix}"] = t
    out[f"{hf}self_attn.o_proj.weight"] = _cat(tps, f"{pre}self_attention.linear_proj.weight", 1)
    if args.qk_norm:
        out[f"{hf}self_attn.q_norm.weight"] = t0[f"{pre}self_attention.q_layernorm.weight"]
        out[f"{hf}self_attn.k_norm.weight"] = t0[f"{pre}self_attention.k_layernorm.weight"]
    fc1 = [s[f"{pre}mlp.linear_fc1.weight"] for s in tps]
    halves = [t.reshape(2, t.shape[0] // 2, t.shape[1]) for t in fc1]  # [2, ffn/tp, h] each
    out[f"{hf}mlp.gate_proj.weight"] = torch.cat([t[0] for t in halves])
    out[f"{hf}mlp.up_proj.weight"] = torch.cat([t[1] for t in halves])
    out[f"{hf}mlp.down_proj.weight"] = _cat(tps, f"{pre}mlp.linear_fc2.weight", 1)


def hf_from_megatron_shards(
    shards: dict[tuple[int, int], dict[str, torch.Tensor]], args: ModelArgs, role: str = "actor"
) -> dict[str, torch.Tensor]:
    """HF state dict from every (tp_rank, pp_rank) -> megatron state dict; vocab padding rows removed.

    Critic/reward shards give the trunk plus ``score.weight`` (SequenceClassification naming).
    """
    tp = 1 + max(t for t, _ in shards)
    pp = 1 + max(p for _, p in shards)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in shards]
    if missing:
        raise ValueError(
            f"megatron shards missing for (tp_rank, pp_rank) {missing}; the checkpoint is incomplete"
        )
    out: dict[str, torch.Tensor] = {}
    for p in range(pp):
        tps = [{k: v for k, v in shards[(t, p)].items() if not k.endswith("_extra_state")} for t in range(tp)]
        tps = [canonical_names(s) for s in tps]
        if p == 0:
            emb = _cat(tps, "embedding.word_embeddings.weight", 0)
            out["model.embed_tokens.weight"] = emb[: args.vocab_size]
        for local, i in enumerate(layer_range(args.num_layers, pp, p)):
            _layer_to_hf(tps, f"decoder.layers.{local}.", args, out, _hf_layer(i))
        if p == pp - 1:
            out["model.norm.weight"] = tps[0]["decoder.final_layernorm.weight"]
            if role in ("critic", "reward"):
                out[VALUE_HEAD] = tps[0]["output_layer.weight"]
            elif not args.tie_word_embeddings:
                out["lm_head.weight"] = _cat(tps, "output_layer.weight", 0)[: args.vocab_size]
    return {k: v.contiguous().clone() for k, v in out.items()}  # no shared storage: safetensors refuses it


def canonical_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename Transformer Engine's fused-norm keys to the local spec's names."""
    inverse = {te: local for local, te in TE_ALIASES.items()}
    out = {}
    for k, v in state.items():
        if "decoder.layers." in k:
            head, _, tail = k.rpartition("decoder.layers.")
            idx, _, rest = tail.partition(".")
            k = f"{head}decoder.layers.{idx}.{inverse.get(rest, rest)}"
        out[k] = v
    return out
