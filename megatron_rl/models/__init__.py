"""Models on megatron-core: HF config -> GPTModel (actor, critic, reward, ref), HF weights in and out.

Typical use, on every rank after ``megatron_rl.distributed.init_distributed(tp, pp)``::

    args = ModelArgs.from_hf_config(hf_dir, tp=tp)
    model = build_model(args, role="actor")
    load_hf_weights(model, hf_dir, args)
    state = export_hf_state_dict(model, args)            # HF names on rank 0, None elsewhere
"""

from megatron_rl.models.args import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    ModelArgs,
    UnsupportedModelError,
    padded_vocab,
)
from megatron_rl.models.builder import ROLES, ValueHead, ValueModel, build_model
from megatron_rl.models.head import set_head_positions
from megatron_rl.models.spec import SDPACoreAttention, layer_spec
from megatron_rl.models.weights import export_hf_state_dict, gather_shards, load_hf_weights, unwrap

__all__ = [
    "ROLES",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "ModelArgs",
    "SDPACoreAttention",
    "UnsupportedModelError",
    "ValueHead",
    "ValueModel",
    "build_model",
    "export_hf_state_dict",
    "set_head_positions",
    "gather_shards",
    "layer_spec",
    "load_hf_weights",
    "padded_vocab",
    "unwrap",
]
