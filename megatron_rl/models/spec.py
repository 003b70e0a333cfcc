"""Transformer-layer ModuleSpecs: megatron-core's local layer with torch SDPA core attention, or the
Transformer Engine layer when transformer-engine is importable.

The stock local ``DotProductAttention`` asks for a CUDA memory buffer and materialises the [T, T] score
matrix; SDPA runs flash/memory-efficient kernels on GPU and works on CPU.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_rl.config.schema import LoRAConfig
from megatron_rl.kernels import bias as bias_kernel
from megatron_rl.kernels import rmsnorm as rmsnorm_kernel
from megatron_rl.kernels.swiglu import SwiGLU
from megatron_rl.models.lora import apply_to_layer_spec
from megatron_rl.models.packed_attention import segment_params_attention

try:  # guarded: TE is a GPU-only extra
    import transformer_engine  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    HAVE_TE = True
except ImportError:
    HAVE_TE = False


class SDPACoreAttention(MegatronModule):
    """Causal (optionally sliding-window, optionally padding-masked) attention through torch SDPA.

    Constructor signature matches megatron-core's ``DotProductAttention`` so it drops into SelfAttention.
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        self.window = config.window_size[0] if config.window_size is not None else None

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """query [T, B, H/tp, D], key/value [T, B, G/tp, D]; attention_mask None (plain causal) or bool
        broadcastable to [B, 1, T, T] with True = masked (megatron convention). Returns [T, B, H/tp*D].
        Packed sequences (``packed_seq_params``, THD): query [S, H/tp, D], key/value [S, G/tp, D] ->
        [S, H/tp, D], causal inside each sequence (``models.packed_attention``)."""
        if packed_seq_params is not None:
            # a SegmentSeqParams (rollout.packing.PackedLayout.seq_params); shared prompts: own key segments
            return segment_params_attention(
                query, key, value, packed_seq_params, self.softmax_scale, self.window
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads, T, D]
        mask = self._keep_mask(attention_mask, q.shape[2], q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True, scale=self.softmax_scale
        )  # [B, H/tp, T, D]
        t_len, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(t_len, b, -1)  # [T, B, H/tp*D]

    def _keep_mask(self, attention_mask, t_len: int, dev) -> torch.Tensor | None:
        """Bool [B|1, 1, T, T] with True = attend, or None when plain causal attention is exact."""
        if attention_mask is None and (self.window is None or t_len <= self.window):
            return None
        idx = torch.arange(t_len, device=dev)
        keep = idx[None, :] <= idx[:, None]  # [T, T] causal
        if self.window is not None:
            keep &= idx[:, None] - idx[None, :] <= self.window
        keep = keep[None, None]  # [1, 1, T, T]
        if attention_mask is not None:
            keep = keep & ~attention_mask.bool()
            # a fully masked row (a padding query) would give NaN; let it attend to itself
            keep = keep | (~keep.any(-1, keepdim=True) & torch.eye(t_len, dtype=torch.bool, device=dev))
        return keep


class RMSNorm(torch.nn.RMSNorm):
    """RMSNorm taking megatron-core's norm constructor arguments. Unlike megatron-core's ``WrappedTorchNorm``
    it allows sequence parallelism: it marks its weight ``sequence_parallel`` so the optimizer sums that
    weight's gradient over TP ranks (each saw a different part of the sequence)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # torch's forward; kernels.rmsnorm's opt-in backward
        normed = rmsnorm_kernel.take_normed(x, self)  # x came from an ``AddNormBDA`` linked to this norm
        if normed is not None:
            return normed
        return rmsnorm_kernel.rms_norm(x, self.weight, self.eps)


class AddNormBDA:
    """megatron-core's bias-dropout-add slot (a layer's ``self_attn_bda`` / ``mlp_bda``) that, once linked to
    the RMSNorm taking its sum next (``link_add_norms``: the layer's pre-MLP norm, the next layer's input norm,
    or the final norm), computes the sum and that norm's output in one kernel (``kernels.rmsnorm.add_rms_norm``)
    and leaves the output on the sum for the norm to return. Where the summand has a bias, dropout is live,
    the kernel cannot take the tensors, or nothing is linked, megatron-core's ``get_bias_dropout_add`` runs,
    as it does unlinked."""

    def __init__(self):
        self.norm: weakref.ref | None = None

    def __call__(self, training: bool, fused: bool):
        plain = get_bias_dropout_add(training, fused)
        norm = self.norm() if self.norm is not None else None
        if norm is None:
            return plain

        def add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if (
                bias is None
                and (prob == 0 or not training)
                and not (norm._forward_pre_hooks or norm._forward_hooks)  # e.g. a parameter all-gather's wait
                and rmsnorm_kernel.fusable(x, residual, norm.weight)
            ):
                s, n = rmsnorm_kernel.add_rms_norm(x, residual, norm.weight, norm.eps)
                return rmsnorm_kernel.stash_normed(s, norm, n)
            return plain(x_with_bias, residual, prob)

        return add


def link_add_norms(model) -> int:
    """Links each ``AddNormBDA`` of ``model``'s decoder layers to the RMSNorm that takes its sum: a layer's
    attention sum goes to its pre-MLP norm, its MLP sum to the next layer's input norm (the final norm after
    this stage's last layer). Not where a layer recomputes or offloads that norm, or where the norm is not
    ``RMSNorm`` itself, nor a layer with cross-attention. Returns the number linked."""
    decoder = getattr(model, "decoder", None)
    layers = list(getattr(decoder, "layers", ()))
    final = getattr(decoder, "final_layernorm", None)
    linked = 0
    for i, layer in enumerate(layers):
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        sites = (
            (layer.self_attn_bda, layer.pre_mlp_layernorm,
             getattr(layer, "recompute_pre_mlp_layernorm", False) or getattr(layer, "offload_mlp_norm", False)
             or not all(isinstance(m, IdentityOp) for m in (layer.pre_cross_attn_layernorm, layer.cross_attention))),
            (layer.mlp_bda, nxt.input_layernorm if nxt is not None else final,
             nxt is not None and (getattr(nxt, "recompute_input_layernorm", False)
                                  or getattr(nxt, "offload_attn_norm", False))),
        )  # fmt: skip
        for bda, norm, apart in sites:
            if isinstance(bda, AddNormBDA) and type(norm) is RMSNorm and not apart:
                bda.norm = weakref.ref(norm)
                linked += 1
    return linked


class QKVLinear(ColumnParallelLinear):
    """megatron-core's local ``linear_qkv`` whose bias (Qwen2's query-key-value bias) is added to its local
    output shard by ``kernels.bias.add_bias`` (compiled both ways) instead of megatron-core's broadcast add;
    the GEMM, its communication and the weight gradient stay megatron-core's. Serves full fine-tuning's
    trainable layers: a LoRA target takes ``models.lora``'s class, and frozen weights (LoRA bases, the
    reference model) run ``fold_frozen_linears``' GEMMs; the exact layers have their own."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if args or kwargs.get("bias") is None:
            return super()._forward_impl(input, weight, *args, **kwargs)
        bias = kwargs.pop("bias")
        return bias_kernel.add_bias(super()._forward_impl(input, weight, *args, bias=None, **kwargs), bias)


def uses_te(backend: str) -> bool:
    """Whether ``backend`` ("auto", "local", "te") builds Transformer Engine layers here."""
    if backend not in ("auto", "local", "te"):
        raise ValueError(f"model backend={backend!r}; use 'auto', 'local' or 'te'")
    if backend == "te" and not HAVE_TE:
        raise ImportError("model backend='te' needs transformer-engine; install it or use backend='local'")
    return backend == "te" or (backend == "auto" and HAVE_TE)


def layer_spec(
    qk_norm: bool, backend: str = "auto", fused_swiglu: bool = False, lora: LoRAConfig | None = None
) -> ModuleSpec:
    """The GPT layer ModuleSpec. ``backend``: "local" (megatron-core modules + SDPA), "te" (Transformer
    Engine; fuses the pre-attention/pre-MLP norms into linear_qkv/linear_fc1) or "auto" (TE if importable).
    ``fused_swiglu``: the local MLP's activation is ``kernels.swiglu.SwiGLU`` (needs the config's
    ``use_te_activation_func``, see ``kernels.mcore``). ``lora`` (rank > 0): its target linear layers are
    the LoRA variants of ``models.lora`` (local backend only).
    """
    if uses_te(backend):
        if lora is not None and lora.enabled:
            raise ValueError(
                "actor.lora / critic.lora (rank > 0) adapts megatron-core's local linear layers, not Transformer "
                "Engine's; build the model with backend='local' (or 'auto', which picks it for LoRA)"
            )
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    spec = copy.deepcopy(get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm"))
    layer, attn = spec.submodules, spec.submodules.self_attention.submodules
    attn.core_attention = SDPACoreAttention
    attn.linear_qkv = QKVLinear
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if qk_norm:
        attn.q_layernorm = attn.k_layernorm = RMSNorm
    if fused_swiglu:
        layer.mlp.submodules.activation_func = SwiGLU
    if lora is not None and lora.enabled:
        apply_to_layer_spec(spec, lora)
    return spec


def block_spec(config, qk_norm: bool, backend: str = "auto", lora: LoRAConfig | None = None):
    """This pipeline stage's decoder block: its layers, and (local backend) our RMSNorm as the final norm
    so that sequence parallelism works without TE/apex."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = layer_spec(qk_norm, backend, fused_swiglu=config.use_te_activation_func, lora=lora)
    if uses_te(backend):
        return layer
    layer.submodules.self_attn_bda = layer.submodules.mlp_bda = AddNormBDA  # linked by ``link_add_norms``
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm
    )
