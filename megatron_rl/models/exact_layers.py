"""The layers of ``rollout.exact_logprobs``: megatron-core's linear layers, our RMSNorm and core attention with
their forward through ``kernels.batch_invariant``, the kernels the rollout engine's decoder calls in the same
mode, so a token's training log-prob and its rollout log-prob are the same bits.

Only the forward values must match the engine; backward uses the plain torch ops (a gradient carries no
log-prob). The MLP's SwiGLU is ``kernels.swiglu.ExactSwiGLU`` (the decoder's exact SwiGLU forward, the fused
backward). Swapped in through our ModuleSpec (``block_spec``: the local spec with these layers) and, for
the LM head GPTModel builds itself, ``exact_head``; megatron-core's code is untouched. At TP>1 (no sequence
parallelism: validation refuses it) a column-parallel linear keeps megatron-core's communication (identity
forward, input-gradient all-reduce), and a row-parallel linear sums its partial outputs with
``batch_invariant_tp.ordered_all_reduce`` (rank order, as the decoder does) instead of megatron-core's
all-reduce.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
)

from megatron_rl.kernels import batch_invariant as bi
from megatron_rl.kernels import wgrad_fusion
from megatron_rl.kernels.batch_invariant_tp import OrderedAllReduce, group_size
from megatron_rl.kernels.swiglu import ExactSwiGLU
from megatron_rl.models.packed_attention import segment_params_attention
from megatron_rl.models.spec import RMSNorm, SDPACoreAttention, layer_spec


class _ExactLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fuse):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.main_grad = getattr(weight, "main_grad", None) if fuse else None  # as megatron-core's forward
        return bi.matmul(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])  # [M, N]
        gx = (g2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            if ctx.main_grad is not None:  # optim.gradient_accumulation_fusion: into main_grad directly
                gw = wgrad_fusion.accumulate(weight, ctx.main_grad, x, grad)
            else:
                gw = g2.t() @ x.reshape(-1, x.shape[-1])
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fuse: bool = False):
    """x [..., K], weight [N, K] -> [..., N]: batch-invariant forward, differentiable; ``fuse``: the weight
    gradient accumulates into ``weight.main_grad`` (``kernels.wgrad_fusion``) where it has one."""
    return _ExactLinear.apply(x, weight, bias, fuse)


def _exact_forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                        tp_group=None, **_tp_comm):  # fmt: skip
    """megatron-core's linear ``_forward_impl`` contract without sequence parallelism: ``allreduce_dgrad``
    (a column-parallel linear at TP>1) all-reduces the input's gradient, as megatron-core's own does."""
    if allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return exact_linear(input, weight, bias, gradient_accumulation_fusion)


class ExactColumnParallelLinear(ColumnParallelLinear):
    _forward_impl = _exact_forward_impl


class ExactRowParallelLinear(RowParallelLinear):
    """x [T, B, in/tp] -> ([T, B, out], bias): the exact matmul of this rank's input shard, the partials
    summed in rank order (``OrderedAllReduce``), then megatron-core's bias handling."""

    def forward(self, input_):
        if not self.input_is_parallel or self.sequence_parallel or self.explicit_expert_comm:
            raise NotImplementedError(
                "rollout.exact_logprobs: row-parallel linears take a parallel input without sequence "
                "parallelism or expert communication; set parallel.sequence_parallel=false"
            )
        out = exact_linear(input_, self.weight, fuse=self.gradient_accumulation_fusion)
        if group_size(self.tp_group) > 1:
            out = OrderedAllReduce.apply(out, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


def exact_head(model) -> None:
    """Route GPTModel's LM head (built by GPTModel, not from the spec) through the exact matmul."""
    if getattr(model, "post_process", False) and isinstance(model.output_layer, ColumnParallelLinear):
        model.output_layer._forward_impl = types.MethodType(_exact_forward_impl, model.output_layer)


class _ExactForward(torch.autograd.Function):
    """``exact(*xs)`` forward; backward differentiates ``plain(*xs)`` (same function up to rounding)."""

    @staticmethod
    def forward(ctx, exact, plain, *xs):
        ctx.plain = plain
        ctx.save_for_backward(*xs)
        return exact(*xs)

    @staticmethod
    def backward(ctx, grad):
        xs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        with torch.enable_grad():
            out = ctx.plain(*xs)
        wanted = [x for x in xs if x.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return None, None, *(next(grads) if x.requires_grad else None for x in xs)


class ExactRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps

        def exact(x, w):
            return bi.rms_norm(x, w, eps)

        def plain(x, w):
            return F.rms_norm(x, (x.shape[-1],), w, eps)

        return _ExactForward.apply(exact, plain, x, self.weight)


class ExactCoreAttention(SDPACoreAttention):
    """Causal attention through ``batch_invariant.causal_attention`` (no padding mask, no window: the
    trainer's micro-batches are right-padded and plain causal), or for packed rows (``pack_sequences``,
    ``share_prompts``: a ``SegmentSeqParams``) ``batch_invariant.packed_attention``, whose every query
    runs the per-row computation of its unpacked sequence; backward through the plain packed kernels."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        """query [T, B, H, D], key / value [T, B, G, D] -> [T, B, H*D]; packed: [S, H, D] -> [S, H, D]."""
        if attention_mask is not None or self.window is not None:
            raise NotImplementedError(
                "rollout.exact_logprobs runs plain causal attention only (no padding mask or sliding "
                "window); set rollout.exact_logprobs=false for this model/batch layout"
            )
        scale = self.softmax_scale
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, scale)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads, T, D]

        def exact(q, k, v):
            return bi.causal_attention(q, k, v, scale)

        def plain(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)

        out = _ExactForward.apply(exact, plain, q, k, v)  # [B, H, T, D]
        t_len, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(t_len, b, -1)  # [T, B, H*D]

    @staticmethod
    def _packed(query, key, value, p, scale):
        def exact(q, k, v):
            return bi.packed_attention(q, k, v, p.segments_q, scale, kv_index=p.kv_index, cu_k=p.segments_k,
                                       max_q=p.max_q, max_k=p.max_k if p.kv_index is not None else p.max_q)  # fmt: skip

        def plain(q, k, v):
            return segment_params_attention(q, k, v, p, scale, None)

        return _ExactForward.apply(exact, plain, query, key, value)  # [S, H, D]


def block_spec(config, qk_norm: bool):
    """This pipeline stage's decoder block with every op on the hidden-state path batch-invariant: the
    local layer spec with these layers swapped in, and ``ExactRMSNorm`` as the final norm."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec = layer_spec(qk_norm, "local")
    layer, attn, mlp = (
        spec.submodules,
        spec.submodules.self_attention.submodules,
        spec.submodules.mlp.submodules,
    )
    attn.core_attention = ExactCoreAttention
    attn.linear_qkv, attn.linear_proj = ExactColumnParallelLinear, ExactRowParallelLinear
    mlp.linear_fc1, mlp.linear_fc2 = ExactColumnParallelLinear, ExactRowParallelLinear
    spec.submodules.mlp.submodules.activation_func = ExactSwiGLU  # with config.use_te_activation_func
    layer.input_layernorm = layer.pre_mlp_layernorm = ExactRMSNorm
    if qk_norm:
        attn.q_layernorm = attn.k_layernorm = ExactRMSNorm
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=ExactRMSNorm
    )
