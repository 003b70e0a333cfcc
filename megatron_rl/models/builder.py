"""Build the megatron-core GPTModel of one role (actor, critic, reward, ref) on the current parallel_state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule

from megatron_rl.config.schema import LoRAConfig
from megatron_rl.distributed import device
from megatron_rl.kernels import rope_exact
from megatron_rl.kernels.mcore import fusion_flags
from megatron_rl.models import exact_layers
from megatron_rl.models.args import ModelArgs
from megatron_rl.models.lora import fold_frozen_linears, freeze_base, init_adapters
from megatron_rl.models.spec import block_spec, link_add_norms, uses_te

ROLES = ("actor", "critic", "reward", "ref")
VALUE_ROLES = ("critic", "reward")
VALUE_HEAD_SEED = 20240607  # same init on every rank: the head is replicated across TP


class ValueHead(MegatronModule):
    """Scalar head replacing GPTModel's output layer: [T, B, h] -> ([T, B, 1], None).

    Replicated across TP (a 1-wide output cannot be split); its weight has HF ``score.weight``'s shape
    [1, h] so a SequenceClassification checkpoint loads as is. Every TP rank sees the full hidden state
    and computes the same values, so its gradient is already the full one on each rank.
    """

    def __init__(self, config, hidden_size: int):
        super().__init__(config=config)
        gen = torch.Generator().manual_seed(VALUE_HEAD_SEED)
        weight = torch.randn(1, hidden_size, generator=gen) * config.init_method_std  # [1, h]
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))
        self.sequence_parallel = False  # read by GPTModel's inference path; forward gathers itself

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.config.sequence_parallel:
            # [T/tp, B, h] -> [T, B, h]; every TP rank then computes the same values, so the backward
            # splits the gradient instead of summing it over TP.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return F.linear(hidden_states, self.weight), None  # [T, B, 1]


class ValueModel(GPTModel):
    """GPTModel whose last stage returns values [B, T] (critic, reward model) instead of logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.post_process and kwargs.get("labels") is None:
            return out.squeeze(-1)  # [B, T, 1] -> [B, T]
        return out


def build_model(
    args: ModelArgs,
    role: str = "actor",
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    sequence_parallel: bool = False,
    recompute: dict | None = None,
    lora: LoRAConfig | None = None,
    exact: bool = False,
) -> GPTModel:
    """A GPTModel for this rank's pipeline stage (pre/post_process from parallel_state).

    actor/ref: the LM head (tied to the embedding when ``args.tie_word_embeddings``); forward gives
    logits [B, T, V/tp] on the last stage. critic/reward: a scalar value head, forward gives [B, T].
    ref: the actor's architecture, in eval mode with requires_grad False.
    Non-last stages return hidden states [T, B, h]. Weights are random until ``load_hf_weights``.
    ``recompute``: megatron-core activation-recomputation fields (``RecomputeKeys.recompute_kwargs``).
    ``lora`` (rank > 0, actor/critic): LoRA adapters on its target layers, initialised (B = 0); every other
    parameter is frozen except a critic's value head.
    ``exact``: ``rollout.exact_logprobs`` (batch-invariant local layers and LM head, the exact SwiGLU
    ``kernels.swiglu.ExactSwiGLU`` and RoPE with megatron-core's unfused rounding, ``kernels.rope_exact``: the
    engine's decoder computes them with the same elementwise ops).
    """
    if role not in ROLES:
        raise ValueError(f"model role={role!r}; use one of {ROLES}")
    if lora is not None and lora.enabled and backend == "auto":
        backend = "local"  # the adapters wrap megatron-core's own linear layers, not Transformer Engine's
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if args.padded_vocab_size % tp:
        raise ValueError(
            f"padded_vocab_size={args.padded_vocab_size} is not divisible by TP={tp}; build ModelArgs "
            f"with ModelArgs.from_hf_config(..., tp={tp}) or args.with_tp({tp})"
        )
    config = args.transformer_config(
        dtype,
        sequence_parallel=sequence_parallel,
        # exact: the MLP hands its whole fc1 output to the spec's ExactSwiGLU (megatron-core's flag name)
        fusions={"use_te_activation_func": True} if exact else fusion_flags(device(), uses_te(backend)),
        recompute=recompute,
    )
    if exact:  # megatron-core's unfused RoPE bits as one kernel, no host sync (kernels.rope_exact)
        rope_exact.install()
        config.exact_rope = True
    is_value = role in VALUE_ROLES
    cls = ValueModel if is_value else GPTModel
    model = cls(
        config=config,
        transformer_layer_spec=exact_layers.block_spec(config, args.qk_norm)
        if exact
        else block_spec(config, args.qk_norm, backend, lora),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings and not is_value,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(args.rope_theta) if float(args.rope_theta).is_integer() else args.rope_theta,
        rope_scaling=args.rope_scaling_factor is not None,
        rope_scaling_factor=args.rope_scaling_factor or 8.0,
    )
    link_add_norms(model)  # the local layers' residual adds fused with the norms after them
    if is_value and model.post_process:
        model.output_layer = ValueHead(config, args.hidden_size)
    elif exact:
        exact_layers.exact_head(model)
    model.to(device())
    if lora is not None and lora.enabled:
        if role not in ("actor", "critic"):
            raise ValueError(f"LoRA adapters are for the trained roles (actor, critic), not role={role!r}")
        init_adapters(model, lora.init)
        freeze_base(model, trainable=("output_layer.weight",) if is_value else ())
    if role == "ref":
        model.eval()
        model.requires_grad_(False)
        if not exact:  # its frozen weights as single GEMMs (exact layers bring their own linears)
            fold_frozen_linears(model)
    return model
