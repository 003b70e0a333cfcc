"""The megatron-core fusion flags our model configs can turn on without transformer-engine or apex.

- ``bias_activation_fusion``: megatron-core's own SwiGLU autograd function, whose forward and backward
  it compiles with ``torch.compile`` (``megatron.core.jit.jit_fuser``): one kernel each way, and only
  the fc1 output is kept for backward instead of fc1 output plus the SiLU output.
- ``apply_rope_fusion``: megatron-core calls ``rope_utils.fused_apply_rotary_pos_emb``, which it takes
  from TE; without TE that slot is empty and we fill it with ``kernels.rope``.

Both are used only where ``kernels.compile`` allows compiling (CUDA by default) and a probe on the
model's device compiles and runs them; otherwise the config keeps megatron-core's unfused paths.
"""

from __future__ import annotations

import torch

from megatron_rl.kernels.compile import probe
from megatron_rl.kernels.rope import compiled_rope, fused_apply_rotary_pos_emb


def _trial(device: torch.device) -> None:
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    x = torch.randn(4, 2, 2, 8, device=device, requires_grad=True)
    freqs = torch.randn(4, 1, 1, 8, device=device)
    y = torch.randn(4, 2, 16, device=device, requires_grad=True)
    (compiled_rope()(x, freqs).sum() + bias_swiglu_impl(y, None).sum()).backward()


def fusion_flags(device: torch.device | str) -> dict[str, bool]:
    """TransformerConfig overrides for a model on ``device``: the two fusions, or {} where they do not
    compile. Fills megatron-core's fused-RoPE slot when TE left it empty."""
    device = torch.device(device)
    if not probe("megatron-core RoPE/SwiGLU fusions", device, lambda: _trial(device)):
        return {}
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_apply_rotary_pos_emb
    return {"apply_rope_fusion": True, "bias_activation_fusion": True}
