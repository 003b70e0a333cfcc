"""Lean functional decoder for generation: the megatron-core GPT forward on a dict of tensors.

It runs the whole layer stack of one generation-TP shard (the weights ``reshard.py`` assembles from the
actor's own parameters), with a preallocated KV cache. Numerics follow HF transformers / megatron-core
(local spec, RMSNorm, rotate-half RoPE, SwiGLU): fp32 results agree to ~1e-6. With ``exact``
(``rollout.exact_logprobs``) prefill and decode run the batch-invariant kernels the trainer's exact layers
run (``kernels.batch_invariant``), the trainer's unfused RoPE and its exact SwiGLU (``kernels.swiglu.exact_forward``),
so logits are the same bits.

Tensor-parallel pieces (``tp`` is the generation TP size, ``group`` its process group):
- vocab-parallel embedding: rows outside this rank's vocab range are masked, partial sums all-reduced;
- qkv / fc1 column-parallel: this rank holds G/tp whole query groups and F/tp of the MLP;
- proj / fc2 row-parallel: partial outputs all-reduced (``exact``: added in rank order);
- output layer vocab-parallel: logits all-gathered, padded vocab columns dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.kernels import batch_invariant as bi
from megatron_rl.kernels import decode_attention as decode_kernel
from megatron_rl.kernels import decode_fused, decode_gemm, swiglu
from megatron_rl.kernels.batch_invariant_tp import ordered_all_reduce
from megatron_rl.kernels.rope import apply_rope, rope_cos_sin, rope_matrix

if TYPE_CHECKING:  # the engine needs no megatron-core import at run time
    from megatron_rl.models.args import ModelArgs


def check_decodable(args: ModelArgs) -> ModelArgs:
    """``args`` if this decoder builds that model exactly, else an error naming what it lacks (the engine
    reads the architecture straight from ``models.ModelArgs``, one definition of the model's facts)."""
    for unsupported in ("rope_scaling_factor", "sliding_window"):
        if getattr(args, unsupported, None):
            raise NotImplementedError(
                f"The rollout decoder does not implement {unsupported}={getattr(args, unsupported)} yet; "
                f"generation would not match the trained model. Use a model without it."
            )
    return args


@dataclass
class GenWeights:
    """One generation-TP shard of the full layer stack. Layer dicts hold the keys
    ``ln1, qkv_w, [qkv_b], [q_norm, k_norm], proj, ln2, fc1, fc2`` (megatron-core layouts)."""

    embed: torch.Tensor  # [Vp/tp, h]
    layers: list[dict[str, torch.Tensor]]
    final_norm: torch.Tensor  # [h]
    output: torch.Tensor  # [Vp/tp, h] (the embedding itself when tied)
    tp: int = 1
    tp_rank: int = 0
    group: dist.ProcessGroup | None = None
    owned: list[torch.Tensor] = field(default_factory=list)  # gathered buffers (not the actor's own)

    def owned_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.owned)


def _all_reduce(x: torch.Tensor, w: GenWeights, exact: bool = False) -> torch.Tensor:
    """Sum a row-parallel partial over the generation TP group; ``exact``: in rank order in fp32
    (``batch_invariant_tp.ordered_all_reduce``, as the trainer's exact row-parallel linears sum)."""
    if w.tp > 1:
        if exact:
            return ordered_all_reduce(x, w.group)
        dist.all_reduce(x, group=w.group)
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, exact: bool = False) -> torch.Tensor:
    """x [..., h] -> normalised [..., h]: fp32 statistics, one rounding after the weight (as megatron-core's
    torch/TE RMSNorm computes it; one fused kernel on GPU)."""
    if exact:
        return bi.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias=None, exact: bool = False) -> torch.Tensor:
    return bi.matmul(x, weight, bias) if exact else F.linear(x, weight, bias)


def embed(tokens: torch.Tensor, w: GenWeights) -> torch.Tensor:
    """tokens [B, T] -> hidden [B, T, h]; vocab-parallel lookup + all-reduce over the generation TP group."""
    if w.tp == 1:
        return F.embedding(tokens, w.embed)
    rows = w.embed.shape[0]
    local = tokens - w.tp_rank * rows
    outside = (local < 0) | (local >= rows)
    h = F.embedding(local.masked_fill(outside, 0), w.embed)
    h = h.masked_fill(outside[..., None], 0.0)
    return _all_reduce(h, w)


def logits(h: torch.Tensor, w: GenWeights, spec: ModelArgs, exact: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """h [B, h] (already final-normed) -> logits [B, V] over the true vocab in the weights' dtype (the
    samplers upcast), gathered across TP. ``out`` [>= B, Vp] (TP 1, not exact): the GEMM writes its first
    B rows (the decode graphs' one logits buffer) and the result is a view of them."""
    if out is not None and w.tp == 1 and not exact:
        # detached: ``out=`` takes no autograd input (generation needs no gradients; tied weights are the
        # actor's parameters)
        local = torch.mm(h.detach(), w.output.detach().t(), out=out[: h.shape[0]])  # [B, Vp]
    else:
        local = bi.matmul(h, w.output) if exact else h @ w.output.t()  # [B, Vp/tp]
    if w.tp > 1:
        parts = [torch.empty_like(local) for _ in range(w.tp)]
        dist.all_gather(parts, local.contiguous(), group=w.group)
        local = torch.cat(parts, dim=-1)  # [B, Vp]
    return local[:, : spec.vocab_size]


def _qkv(x: torch.Tensor, layer: dict, spec: ModelArgs, exact: bool = False) -> torch.Tensor:
    """x [B, T, h] -> qkv [B, T, Gl, rep+2, D] (megatron-core layout: per group rep q heads, k, v) with
    qk-norm applied, before RoPE."""
    B, T, _ = x.shape
    rep = spec.num_attention_heads // spec.num_query_groups
    qkv = _linear(x, layer["qkv_w"], layer.get("qkv_b"), exact)  # [B, T, Gl*(rep+2)*D]
    qkv = qkv.view(B, T, -1, rep + 2, spec.head_dim)  # [B, T, Gl, rep+2, D]
    if spec.qk_norm:
        q = rms_norm(qkv[:, :, :, :rep], layer["q_norm"], spec.norm_eps, exact)
        k = rms_norm(qkv[:, :, :, rep : rep + 1], layer["k_norm"], spec.norm_eps, exact)
        qkv = torch.cat((q, k, qkv[:, :, :, rep + 1 :]), dim=3)
    return qkv


def _mlp(x: torch.Tensor, layer: dict, w: GenWeights, exact: bool = False) -> torch.Tensor:
    if exact:  # the trainer's exact SwiGLU (kernels.swiglu.ExactSwiGLU) on one fc1 output
        y = bi.matmul(x, layer["fc1"])  # [B, T, 2F/tp]: gate, then up
        act = swiglu.exact_forward(y.reshape(-1, y.shape[-1])).view(*y.shape[:-1], -1)
        return _all_reduce(bi.matmul(act, layer["fc2"]), w, exact=True)
    # gate and up as two matmuls on the weight's (contiguous) row halves: contiguous outputs keep the
    # SwiGLU elementwise kernels vectorised (a chunk of one output is strided)
    gate_w, up_w = layer["fc1"].chunk(2, dim=0)  # [F/tp, h] each
    return _all_reduce(F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), layer["fc2"]), w)


def decode_attention(q, k, v, mask, positions, prefix=None) -> torch.Tensor:
    """q [B, Gl, rep, D] (a group's query heads as the query axis), k / v [B, Gl, T, D], additive mask
    [B, 1, 1, T] hiding keys past ``positions`` [B] (None: built here if SDPA serves) -> [B, Gl, rep, D].

    The Triton kernel (``kernels.decode_attention``) where it runs (bf16/fp16 on CUDA); SDPA with the
    mask otherwise. ``prefix`` (lead [B], plen [B]): the kernel reads each row's prompt from its lead
    slot's copy (``rollout.prompt_kv_sharing``); SDPA reads the row's own copy, the same values."""
    if decode_kernel.usable(q):
        return decode_kernel.decode_attention(q, k, v, positions, prefix=prefix)
    if mask is None:  # the caller expected the kernel (``_decode_fused``): the mask for this layer alone
        mask = _decode_mask(positions, k.shape[2], q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _prefill_layers(
    w: GenWeights, spec: ModelArgs, x: torch.Tensor, cos, sin, attend, exact: bool = False
) -> torch.Tensor:
    """The layer stack over a block of new tokens: x [B, T, h] -> [B, T, h]. ``attend(i, q, k, v)`` writes
    layer i's new keys/values into the cache and attends (q [B, Hl, T, D], k / v [B, T, Gl, D] after RoPE)
    -> [B, Hl, T, D]; it is the only difference between a first prefill and an extension of a slot."""
    B, T, _ = x.shape
    rep = spec.num_attention_heads // spec.num_query_groups
    for i, layer in enumerate(w.layers):
        qkv = _qkv(
            rms_norm(x, layer["ln1"], spec.norm_eps, exact), layer, spec, exact
        )  # [B, T, Gl, rep+2, D]
        qk = apply_rope(qkv[:, :, :, : rep + 1], cos, sin)  # [B, T, Gl, rep+1, D]
        q = qk[:, :, :, :rep].reshape(B, T, -1, spec.head_dim).transpose(1, 2)  # [B, Hl, T, D]
        a = attend(i, q, qk[:, :, :, rep], qkv[:, :, :, rep + 1])  # [B, Hl, T, D]
        a = a.transpose(1, 2).reshape(B, T, -1)  # [B, T, Hl*D]
        x = x + _all_reduce(_linear(a, layer["proj"], exact=exact), w, exact)
        x = x + _mlp(rms_norm(x, layer["ln2"], spec.norm_eps, exact), layer, w, exact)
    return x


def _last_logits(
    x: torch.Tensor, lengths: torch.Tensor, w: GenWeights, spec: ModelArgs, exact: bool = False
) -> torch.Tensor:
    """x [B, T, h] -> logits [B, V] of each row's last real token (``lengths`` [B])."""
    last = x[torch.arange(x.shape[0], device=x.device), lengths - 1]  # [B, h]
    return logits(rms_norm(last, w.final_norm, spec.norm_eps, exact), w, spec, exact)


def prefill(
    w: GenWeights,
    spec: ModelArgs,
    cache: torch.Tensor,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    exact: bool = False,
) -> torch.Tensor:
    """Run right-padded prompts, fill their cache slots, return the last real token's logits.

    tokens [B, T] (right-padded), lengths [B], slots [B]; cache [L, 2, S, Gl, Tmax, D].
    Returns logits [B, V] (weights' dtype). Pad keys land in the cache past each length and are masked (then
    overwritten) by decode, so a plain causal mask is exact for the real tokens.
    """
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)  # [B, T]
    cos, sin = rope_cos_sin(positions, spec.head_dim, spec.rope_theta, w.embed.dtype)

    def attend(i, q, k, v):
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Gl, T, D]
        cache[i, 0, slots, :, :T] = k
        cache[i, 1, slots, :, :T] = v
        if exact:
            return bi.causal_attention(q, k, v, spec.head_dim**-0.5)  # [B, Hl, T, D]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    x = _prefill_layers(w, spec, embed(tokens, w), cos, sin, attend, exact)
    return _last_logits(x, lengths, w, spec, exact)


def _decode_mask(positions: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, 1, kv_len] hiding keys past each row's position: one for all layers (a boolean
    mask would be converted again in every layer)."""
    visible = torch.arange(kv_len, device=positions.device)[None, :] <= positions[:, None]  # [B, kv_len]
    mask = torch.zeros(positions.shape[0], 1, 1, kv_len, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~visible[:, None, None, :], float("-inf"))


def decode(
    w: GenWeights,
    spec: ModelArgs,
    cache: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    kv_len: int | None = None,
    exact: bool = False,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    logits_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step for slots 0..B-1 (static shapes, CUDA-graph capturable).

    tokens [B] (the token at ``positions``), positions [B]; cache [L, 2, S, Gl, Tmax, D] with S >= B.
    Writes each slot's new key/value at its position and attends to keys 0..position, reading only the
    first ``kv_len`` cache positions (default all; every position must be < kv_len).
    ``prefix`` (lead [B], plen [B]): ``decode_attention``'s; ``logits_out``: ``logits``' ``out``. Returns
    logits [B, V] (weights' dtype).
    """
    B = tokens.shape[0]
    Tmax = cache.shape[4] if kv_len is None else kv_len
    if not exact and decode_fused.enabled(w.embed):
        return _decode_fused(w, spec, cache, tokens, positions, Tmax, prefix, logits_out)
    rep = spec.num_attention_heads // spec.num_query_groups
    batch = torch.arange(B, device=tokens.device)
    cos, sin = rope_cos_sin(positions[:, None], spec.head_dim, spec.rope_theta, w.embed.dtype)
    rope = rope_matrix(cos[:, 0, 0, 0], sin[:, 0, 0, 0])  # [B, D, D]
    mask = _decode_mask(positions, Tmax, w.embed.dtype)  # [B, 1, 1, Tmax]
    x = embed(tokens[:, None], w)  # [B, 1, h]
    h = rms_norm(x, w.layers[0]["ln1"] if w.layers else w.final_norm, spec.norm_eps, exact)
    for i, layer in enumerate(w.layers):
        qkv = _qkv(h, layer, spec, exact)[:, 0]  # [B, Gl, rep+2, D]
        k_cache, v_cache = cache[i, 0, :B, :, :Tmax], cache[i, 1, :B, :, :Tmax]  # [B, Gl, Tmax, D]
        if exact and decode_fused.usable("rope_kv_write_exact", qkv):  # the eager rounding, one kernel
            q = decode_fused.rope_kv_write(qkv, cos[:, 0, 0, 0], sin[:, 0, 0, 0], positions, k_cache, v_cache,
                                           exact=True)  # fmt: skip
        else:
            if exact:  # the trainer's elementwise RoPE (a matmul would round differently)
                rot = apply_rope(qkv, cos[:, 0], sin[:, 0])  # [B, Gl, rep+2, D]
            else:  # all rows rotated in one matmul; the rotated v row is not used
                rot = torch.bmm(qkv.reshape(B, -1, spec.head_dim), rope).view(qkv.shape)  # [B, Gl, rep+2, D]
            k_cache[batch, :, positions] = rot[:, :, rep]
            v_cache[batch, :, positions] = qkv[:, :, rep + 1]
            # the rep query heads of a group share its K/V: they are the query-length axis (no K/V copy)
            q = rot[:, :, :rep]  # [B, Gl, rep, D]
        if exact:
            a = bi.decode_attention(q, k_cache, v_cache, positions, spec.head_dim**-0.5, prefix)
        else:
            a = decode_attention(q, k_cache, v_cache, mask, positions, prefix)  # [B, Gl, rep, D]
        a = a.reshape(B, 1, -1)  # [B, 1, Hl*D]
        nxt = w.layers[i + 1]["ln1"] if i + 1 < len(w.layers) else w.final_norm
        x, h = _add_norm(
            x, _all_reduce(_linear(a, layer["proj"], exact=exact), w, exact), layer["ln2"], spec, exact
        )
        x, h = _add_norm(x, _mlp(h, layer, w, exact), nxt, spec, exact)
    return logits(h[:, 0], w, spec, exact, logits_out)


def _add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, spec: ModelArgs, exact: bool):
    """The residual add and the RMSNorm after it: (x + y, norm of it). Exact: ``batch_invariant.add_rms_norm``
    (one kernel, the bits of the add and then the exact norm, which the trainer runs apart); else the fused
    decode kernel where it passed its trial (``decode_fused``; never on ``decode``'s own path, which runs
    only where those kernels are off), else the two ops."""
    if exact:
        return bi.add_rms_norm(x, y, weight, spec.norm_eps)
    if decode_fused.usable("add_rms_norm", x):
        return decode_fused.add_rms_norm(x, y, weight, spec.norm_eps)
    x = x + y
    return x, rms_norm(x, weight, spec.norm_eps)


def _decode_fused(w: GenWeights, spec: ModelArgs, cache: torch.Tensor, tokens: torch.Tensor,
                  positions: torch.Tensor, Tmax: int, prefix=None, logits_out=None) -> torch.Tensor:  # fmt: skip
    """``decode`` with the fused Triton kernels (``kernels.decode_fused``, on by default on CUDA, ``MEGATRON_RL_FUSED_DECODE=0`` off),
    each where its trial passed (else that step's reference ops): RoPE + the KV-cache write in one kernel,
    each residual add with the RMSNorm after it, SwiGLU on one fc1 GEMM's output; and ``decode_gemm``'s GEMMs
    with their neighbours inside at the row counts its table names (qkv + RoPE + KV write, fc1 + SwiGLU, fc2 /
    proj with add + RMSNorm). Not the exact path."""
    B = tokens.shape[0]
    rep = spec.num_attention_heads // spec.num_query_groups
    eps = spec.norm_eps
    cos, sin = rope_cos_sin(positions[:, None], spec.head_dim, spec.rope_theta, w.embed.dtype)
    cos2, sin2 = cos[:, 0, 0, 0], sin[:, 0, 0, 0]  # [B, D]
    # [B, 1, 1, Tmax] for SDPA; the Triton attention kernel reads the positions (no mask: ~5 kernels a step less)
    triton_attention = decode_kernel.serves(positions.device, w.embed.dtype, spec.head_dim)
    mask = None if triton_attention else _decode_mask(positions, Tmax, w.embed.dtype)
    x = embed(tokens[:, None], w)[:, 0]  # [B, h]

    h = rms_norm(x, w.layers[0]["ln1"], eps) if w.layers else x
    for i, layer in enumerate(w.layers):
        k_cache, v_cache = cache[i, 0, :B, :, :Tmax], cache[i, 1, :B, :, :Tmax]  # [B, Gl, Tmax, D]
        qs = None  # decode_gemm's qkv GEMM with RoPE and the KV write (no qk-norm between them)
        if not spec.qk_norm and not decode_kernel.ROPE_IN_ATTENTION:
            qs = decode_gemm.usable("qkv", h, layer["qkv_w"], layer.get("qkv_b"), rep, spec.head_dim)
        if qs is not None:
            q = decode_gemm.qkv_rope(h, layer["qkv_w"], layer.get("qkv_b"), cos2, sin2, positions, k_cache, v_cache,
                                     rep, spec.head_dim, **qs)  # [B, Gl, rep, D]  # fmt: skip
            a = decode_attention(q, k_cache, v_cache, mask, positions, prefix)
        else:
            a = _rope_attention(h, layer, spec, cos, sin, positions, k_cache, v_cache, mask, prefix)
        a = a.reshape(B, -1)  # [B, Hl*D]
        x, h = _linear_add_norm(x, a, layer["proj"], layer["ln2"], w, spec, "proj")
        act = _fc1_swiglu(h, layer["fc1"])  # [B, F/tp]
        nxt = w.layers[i + 1]["ln1"] if i + 1 < len(w.layers) else w.final_norm
        x, h = _linear_add_norm(x, act, layer["fc2"], nxt, w, spec, "fc2")
    if not w.layers:
        h = rms_norm(x, w.final_norm, eps)
    return logits(h, w, spec, out=logits_out)


def _rope_attention(h, layer, spec: ModelArgs, cos, sin, positions, k_cache, v_cache, mask, prefix):
    """The decode step's qkv GEMM (cuBLAS), qk-norm, RoPE with the KV-cache write and attention ->
    [B, Gl, rep, D]: the fused Triton kernels where their trials passed (RoPE and the KV write in one, or with
    ``ROPE_IN_ATTENTION`` inside the attention kernel), else the reference ops."""
    B, rep = h.shape[0], spec.num_attention_heads // spec.num_query_groups
    cos2, sin2 = cos[:, 0, 0, 0], sin[:, 0, 0, 0]  # [B, D]
    qkv = _qkv(h[:, None], layer, spec)[:, 0]  # [B, Gl, rep+2, D]
    fused_rope = decode_fused.usable("rope_kv_write", qkv)
    if fused_rope and decode_kernel.rope_usable(qkv):  # RoPE, the KV write and attention in one kernel
        return decode_kernel.rope_decode_attention(qkv, cos2, sin2, k_cache, v_cache, positions, prefix)
    if fused_rope:
        q = decode_fused.rope_kv_write(qkv, cos2, sin2, positions, k_cache, v_cache)  # [B, Gl, rep, D]
    else:
        rot = apply_rope(qkv, cos[:, 0], sin[:, 0])
        batch = torch.arange(B, device=h.device)
        k_cache[batch, :, positions] = rot[:, :, rep]
        v_cache[batch, :, positions] = qkv[:, :, rep + 1]
        q = rot[:, :, :rep]
    return decode_attention(q, k_cache, v_cache, mask, positions, prefix)


def _fc1_swiglu(h: torch.Tensor, fc1: torch.Tensor) -> torch.Tensor:
    """SwiGLU of fc1 (gate rows, then up rows) for the decode step's rows: ``decode_gemm.swiglu_gemm`` (one
    kernel) where its table and trial say so, else cuBLAS and the fused (or reference) SwiGLU."""
    s = decode_gemm.usable("fc1", h, fc1)
    if s is not None:
        return decode_gemm.swiglu_gemm(h, fc1, **s)
    y = F.linear(h, fc1)  # [B, 2F/tp]: gate, then up
    return decode_fused.swiglu(y) if decode_fused.usable("swiglu", y) else _swiglu_ref(y)


def _linear_add_norm(x, a, weight, norm, w: GenWeights, spec: ModelArgs, part: str):
    """(x + a @ weight.T, its RMSNorm) for a row-parallel linear (fc2, the attention output projection):
    ``decode_gemm``'s split-K GEMM with its reduction inside the add + RMSNorm kernel where its table and
    trial say so (generation TP 1: no all-reduce between), else cuBLAS, the all-reduce and ``_add_norm``."""
    s = decode_gemm.usable(part, a, weight) if w.tp == 1 else None
    if s is not None:
        return decode_gemm.add_rms_norm_parts(x, decode_gemm.partials(a, weight, s), norm, spec.norm_eps)
    return _add_norm(x, _all_reduce(F.linear(a, weight), w), norm, spec, False)


def _swiglu_ref(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def extend(
    w: GenWeights,
    spec: ModelArgs,
    cache: torch.Tensor,
    tokens: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Prefill more tokens onto slots that already hold a sequence (the next turn of a multi-turn episode).

    tokens [B, T] (right-padded) go at positions ``starts[b] .. starts[b] + lengths[b] - 1`` of slots
    [B]; they attend to the slot's cached keys before them and causally among themselves. Only the real
    tokens' keys/values are written (pads could land past the cache's end). cache [L, 2, S, Gl, Tmax, D].
    Returns the last real token's logits [B, V] (weights' dtype).
    """
    B, T = tokens.shape
    dev = tokens.device
    positions = starts[:, None] + torch.arange(T, device=dev)  # [B, T]
    valid = torch.arange(T, device=dev)[None, :] < lengths[:, None]  # [B, T]
    end = int((starts + lengths).max())
    rows, cols = valid.nonzero(as_tuple=True)  # [N] each: the real tokens
    at_slot, at_pos = slots[rows], positions[rows, cols]  # [N]
    visible = torch.arange(end, device=dev)[None, None, :] <= positions[:, :, None]  # [B, T, end]
    mask = torch.zeros(B, 1, T, end, dtype=w.embed.dtype, device=dev)
    mask.masked_fill_(~visible[:, None], float("-inf"))  # [B, 1, T, end]
    cos, sin = rope_cos_sin(positions, spec.head_dim, spec.rope_theta, w.embed.dtype)

    def attend(i, q, k, v):
        cache[i, 0][at_slot, :, at_pos] = k[rows, cols]  # [N, Gl, D]
        cache[i, 1][at_slot, :, at_pos] = v[rows, cols]
        k, v = cache[i, 0, slots, :, :end], cache[i, 1, slots, :, :end]  # [B, Gl, end, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return _last_logits(_prefill_layers(w, spec, embed(tokens, w), cos, sin, attend), lengths, w, spec)
